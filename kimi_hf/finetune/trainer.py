"""The loop of `kimi-hf finetune` on one rank of any layout: the rank's model (`kimi_hf.distributed.parallelize`),
MuonClip or AdamW with a warm-up and a schedule, the step (`train_step`: the same global batch on every layout, the
loss divided right), gradient clipping by the whole model's norm, held-out evaluation, DCP checkpoints to resume from,
and at the end the adapter in the released names and / or the merged export.

    losses = finetune(options, config, dims, train_source, eval_source)     # kimi_hf.finetune.cli builds them
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Options:
    """The settings of a run (the CLI's flags; `kimi-hf finetune --help` says each)."""

    model: str
    steps: int = 100
    seed: int = 0
    lora: bool = True
    lora_rank: int = 16
    optimizer: str = "muonclip"
    lr: float = 2e-4
    warmup: int = 0
    schedule: str = "cosine"
    max_grad_norm: float = 1.0
    qk_clip_tau: float = 100.0
    seq_len: int = 4096
    micro_batch: int = 1
    micro_batches: int = 1
    pipeline_schedule: str = "1f1b"
    loss_chunk_size: int | None = 1024
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    eval_every: int = 0
    checkpoint_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    save_adapter: str | None = None
    export: str | None = None
    overwrite: bool = False
    log_dir: str | None = None


def make_optimizer(options: Options, rank):
    """MuonClip (QK-Clip's maxima and Newton-Schulz work over the ranks holding this rank's layers) or AdamW."""
    from ..optim import MuonClip

    if options.optimizer == "muonclip":
        group = rank.groups.get("replica")
        return MuonClip.from_model(rank.model, lr=options.lr, qk_clip_tau=options.qk_clip_tau, process_group=group)
    trainable = [p for p in rank.model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=options.lr, weight_decay=0.1)


def _due(done: int, every: int, steps: int) -> bool:
    """After `done` steps: the last step, or every `every` steps (0: the last only)."""
    return done == steps or bool(every and done % every == 0)


def evaluate(rank, source, rows: int) -> float:
    """The mean loss over the held-out rows (one epoch, in order; every rank runs the same batches)."""
    from ..distributed.train_step import eval_step

    totals = torch.zeros(2, device=rank.device)
    for batch in source.epoch_batches(rows):
        totals += eval_step(rank, batch)
    if dist.is_initialized():
        dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1)).item()


def finetune(options: Options, config, dims, train_source, eval_source=None) -> list[float]:
    """Trains on this rank (the process group up when the world has more than one rank: `init_distributed`);
    returns the steps' losses (every rank: the all-reduced mean). Rank 0 reports (`Metrics`)."""
    from ..distributed import clip_grad_norm, init_distributed, parallelize, train_step
    from ..distributed.checkpoint import TrainState, load_checkpoint, save_checkpoint
    from ..lora_targets import lora_config
    from ..optim import track_expert_load, update_expert_bias
    from .metrics import Metrics
    from .schedule import lr_scheduler

    rank_id, world, device = init_distributed()
    torch.manual_seed(options.seed)
    rank = parallelize(
        options.model,
        dims,
        config=config,
        lora=lora_config(config, options.lora_rank) if options.lora else None,
        seed=options.seed,
        dtype=getattr(torch, options.dtype),
        gradient_checkpointing=options.gradient_checkpointing,
        micro_batch=options.micro_batch,
        micro_batches=options.micro_batches,
        seq_len=options.seq_len,
        schedule=options.pipeline_schedule,
        loss_chunk_size=options.loss_chunk_size,
        device=device,
    )
    opt = make_optimizer(options, rank)
    scheduler = lr_scheduler(opt, options.steps, options.warmup, options.schedule)
    balance = not options.lora  # LoRA keeps the base model's expert biases
    if balance:
        track_expert_load(rank.model)
    state = TrainState(rank.model, opt, scheduler, trainable_only=options.lora)
    start = load_checkpoint(options.checkpoint_dir, state) if options.resume else 0
    metrics = Metrics(rank_id, options.steps, start, options.log_dir)
    trainable = [p for p in rank.model.parameters() if p.requires_grad]
    rows = options.micro_batches * options.micro_batch
    losses = []
    try:
        for step in range(start, options.steps):
            loss = train_step(rank, train_source.global_batch(step, rows))
            norm = None
            if options.max_grad_norm > 0:
                norm = clip_grad_norm(trainable, options.max_grad_norm, rank.groups.get("pipeline")).item()
            lr = scheduler.get_last_lr()[0]
            opt.step()
            scheduler.step()
            opt.zero_grad(set_to_none=True)
            if balance:
                update_expert_bias(rank.model, update_rate=1e-3, group=rank.groups.get("replica"))
            if world > 1:
                dist.all_reduce(loss)  # the data ranks' (and, under pp, the last stage's) shares of the mean
            losses.append(loss.item())
            metrics.step(step, losses[-1], lr, norm)
            done = step + 1
            if eval_source is not None and _due(done, options.eval_every, options.steps):
                metrics.eval(step, evaluate(rank, eval_source, rows))
            if options.checkpoint_dir and _due(done, options.save_every, options.steps):
                save_checkpoint(options.checkpoint_dir, state, done)
        if options.save_adapter:
            save_adapter(options, rank, rank_id, world)
        if options.export:
            export(options, rank_id, world)
    finally:
        metrics.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return losses


def save_adapter(options: Options, rank, rank_id: int, world: int) -> None:
    """The trained LoRA adapter as a PEFT folder in Kimi K3's released module names (kimi_hf.adapters_released):
    gathered whole first (a collective: sharded adapters, and under pp every stage's), then written by rank 0 as a
    PEFT folder of the trained names, converted from there (the whole model's module tree comes from --model's
    config, whatever this rank holds)."""
    import tempfile

    from safetensors.torch import save_file

    from ..adapters_released import save_released_adapter

    state = _full_adapter_state(rank)
    if rank_id == 0:
        with tempfile.TemporaryDirectory() as trained:
            rank.model.peft_config["default"].save_pretrained(trained)
            save_file(
                {k: t.contiguous() for k, t in state.items()}, os.path.join(trained, "adapter_model.safetensors")
            )
            save_released_adapter(trained, options.save_adapter, base=options.model, overwrite=options.overwrite)
    if world > 1:
        dist.barrier()


def _full_adapter_state(rank) -> dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's names, whole on every rank (DTensors gathered: a collective). Under pp each
    stage holds its own layers' adapters: they are gathered from every stage onto every rank."""
    from ..adapters_released import adapter_tensors

    state = adapter_tensors(rank.model)
    if rank.stage is not None and dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, state)
        for part in parts:
            state.update(part)
    return state


def export(options: Options, rank_id: int, world: int) -> None:
    """Rank 0 writes the official K3 layout from the last saved step, streaming (a layer or a source shard at a
    time); the other ranks wait."""
    from ..distributed.checkpoint import checkpoint_steps
    from ..distributed.export import export_full, export_lora
    from ..lora_targets import LORA_ALPHA_PER_RANK  # alpha / r

    if rank_id == 0:
        step_dir = os.path.join(options.checkpoint_dir, f"step-{checkpoint_steps(options.checkpoint_dir)[-1]}")
        if options.lora:
            export_lora(
                step_dir, options.model, options.export, scaling=LORA_ALPHA_PER_RANK, overwrite=options.overwrite
            )
        else:
            export_full(step_dir, options.model, options.export, overwrite=options.overwrite)
    if world > 1:
        dist.barrier()


__all__ = ["Options", "evaluate", "finetune", "make_optimizer"]
