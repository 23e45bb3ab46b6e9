"""Run by test_pipeline.py under torchrun (gloo, CPU): train tiny Kimi K3 / Kimi Linear models on a pipeline of
torch.distributed.pipelining stages (PP 2, PP 2 x FSDP2 2 on 4 ranks, or PP 2 x FSDP2 2 x EP 2: each stage loaded
from a saved folder with its experts split over its 2 data ranks, which in some cases also split each sequence
(context parallelism)), and write what each rank holds: the losses, the
first step's gradients and the weights after the last step, by parameter name. `reference(case)` is the same
training in one process, the whole batch at once.

    python -m torch.distributed.run --nproc_per_node 2 pp_worker.py OUT_DIR [--fsdp 2 [--ep 2]]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kimi_hf.distributed import (
    CausalLMLoss,
    KimiPipelineStageModule,
    PipelineStageInfo,
    build_schedule,
    load_pipeline_stage,
    shard_stage,
)
from kimi_hf.distributed.context import context_parallel_batch, context_parallel_group, enable_context_parallel
from kimi_hf.distributed.pipeline import prune_to_stage
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import _RoutedExperts
from kimi_hf.optim import MuonClip, track_expert_load, update_expert_bias


STEPS = 2
BATCH, SEQ = 4, 16


@dataclass(frozen=True)
class Case:
    name: str
    arch: str  # "k3" (Block AttnRes, a block = 2 layers), "hybrid" (no AttnRes), "hybrid_block" (block of 3 sublayers)
    schedule: str
    split: tuple[int, ...] | None  # layers per stage (None: even)
    optimizer: str  # "muonclip" | "adamw"
    cp: int = 1  # context parallelism: the stage's data ranks split each sequence (kimi_hf.distributed.context)
    per_rank: int = 1  # > 1: interleaved stages (rank r holds stages r, r + pp, ...; schedule interleaved_1f1b)


# K3: 4 layers, a block every 2 layers: [1, 3] puts the boundary inside a block, [2, 2] on a block edge
CASES = (
    Case("k3_gpipe_inside_block_muonclip", "k3", "gpipe", (1, 3), "muonclip"),
    Case("k3_1f1b_block_edge_adamw", "k3", "1f1b", (2, 2), "adamw"),
    Case("k3_1f1b_inside_block_adamw", "k3", "1f1b", (3, 1), "adamw"),
    Case("hybrid_1f1b_muonclip", "hybrid", "1f1b", None, "muonclip"),
    Case("hybrid_block_gpipe_adamw", "hybrid_block", "gpipe", (1, 3), "adamw"),
    # 4 stages of one layer on 2 ranks: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3 (K3: boundaries inside a
    # block, on its edge, inside the next)
    Case("k3_interleaved_muonclip", "k3", "interleaved_1f1b", None, "muonclip", per_rank=2),
    Case("hybrid_block_interleaved_adamw", "hybrid_block", "interleaved_1f1b", None, "adamw", per_rank=2),
)
FSDP_CASES = (
    Case("k3_1f1b_fsdp_muonclip", "k3", "1f1b", (2, 2), "muonclip"),
    Case("hybrid_gpipe_fsdp_adamw", "hybrid", "gpipe", (1, 3), "adamw"),
)
# PP 2 x FSDP2 2 x EP 2: a stage's 2 data ranks hold half of the experts each, their tokens exchanged (all-to-all);
# with cp 2 the same 2 ranks split each sequence instead of taking half of the batch
EP_CASES = (
    Case("k3_1f1b_inside_block_ep_muonclip", "k3", "1f1b", (1, 3), "muonclip"),
    Case("k3_gpipe_block_edge_ep_cp_adamw", "k3", "gpipe", (2, 2), "adamw", cp=2),
    Case("hybrid_1f1b_ep_adamw", "hybrid", "1f1b", (2, 2), "adamw"),
    Case("hybrid_block_1f1b_ep_cp_muonclip", "hybrid_block", "1f1b", (1, 3), "muonclip", cp=2),
)


def build(arch: str):
    torch.manual_seed(0)
    if arch == "k3":
        from kimi_hf import KimiK3ForConditionalGeneration
        from kimi_hf.presets import small_k3_config

        cfg = small_k3_config(64, 4, vocab_size=100, media_token_id=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return KimiK3ForConditionalGeneration._from_config(cfg, attn_implementation="eager").train()
    from kimi_hf import KimiHybridForCausalLM
    from tests.models.kimi_hybrid.helpers import tiny_config

    extra = {"attn_residual": "block", "attn_residual_block_size": 3} if arch == "hybrid_block" else {}
    cfg = tiny_config(attn_implementation="eager", tie_word_embeddings=False, **extra)
    return KimiHybridForCausalLM(cfg).train()


def batch(step: int) -> torch.Tensor:
    return torch.randint(3, 97, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def qk_tau(arch: str) -> float:
    return 0.05 if arch == "k3" else 0.5


def optimizer(case: Case, model, group=None):
    if case.optimizer == "adamw":
        # lr 1e-3: Adam divides by the gradient's own size, so an element whose gradient is rounding noise moves by lr
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.1)
    return MuonClip.from_model(model, lr=1e-2, qk_clip_tau=qk_tau(case.arch), process_group=group)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def reference(case: Case) -> dict:
    """One process: the whole batch in one forward, the model's own loss."""
    model = build(case.arch)
    opt = optimizer(case, model)
    track_expert_load(model)
    losses, grads = [], {}
    for step in range(STEPS):
        x = batch(step)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, update_rate=1e-2)
        losses.append(loss.item())
    weights = {n: _full(p) for n, p in model.named_parameters()}
    weights.update({n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    clipped = opt.qk_clip.total_clipped_heads if getattr(opt, "qk_clip", None) else None
    return {"losses": losses, "grads": grads, "weights": weights, "clipped": clipped}


def load_stage(case: Case, stage: PipelineStageInfo, dp: int, ep: int, out_dir: str):
    """The stage of the model `build` gives, saved by rank 0 and loaded with its experts over ep data ranks."""
    from transformers.distributed import DistributedConfig

    folder = os.path.join(out_dir, f"{case.name}.model")
    model = build(case.arch)
    if dist.get_rank() == 0:
        model.save_pretrained(folder)
    dist.barrier()
    kwargs = {"experts_format": "dense"} if case.arch == "k3" else {}
    config = DistributedConfig(ep_size=ep, fsdp_size=dp)
    loaded = load_pipeline_stage(
        type(model),
        folder,
        stage,
        distributed_config=config,
        dtype=torch.float32,
        attn_implementation="eager",
        **kwargs,
    )
    return loaded.train()


def run_case(case: Case, mesh, out_dir: str, ep: int = 1) -> None:
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    layers = build(case.arch).config.get_text_config().num_hidden_layers
    if case.per_rank > 1:  # this rank's stages of an interleaved split (no data parallelism)
        stage = PipelineStageInfo.interleaved(layers, pp_rank, pp, case.per_rank, case.split)
    else:
        stage = PipelineStageInfo.split(layers, pp_rank, pp, case.split)
    stages = stage if isinstance(stage, tuple) else (stage,)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    if ep > 1:
        model = load_stage(case, stage, dp, ep, out_dir)
    else:
        model = prune_to_stage(build(case.arch), stage)
    if case.per_rank > 1:
        module = model  # build_schedule wraps each of the rank's stages
    else:
        module = shard_stage(model, stage, mesh["dp"]) if dp > 1 else KimiPipelineStageModule(model, stage)
    # how many experts each of the stage's MoE layers holds on this rank (transformers' EP keeps num_experts / ep)
    local_experts = sorted({m.num_experts for m in model.modules() if isinstance(m, _RoutedExperts)})
    replicas = mesh["dp"].get_group()
    opt = optimizer(case, model, replicas)
    track_expert_load(model)
    cp_group, batches = None, dp // case.cp  # data ranks of distinct sequences
    if case.cp > 1:
        cp_group = context_parallel_group(dp_rank, case.cp, pp_rank=pp_rank)
        enable_context_parallel(model, cp_group)
    n_micro = BATCH // batches  # one sequence a micro-batch
    vocab = model.config.get_text_config().vocab_size
    loss_fn = CausalLMLoss(vocab, grad_divide=dp, shifted=case.cp > 1)
    schedule = build_schedule(
        module, stage, mesh["pp"].get_group(), n_micro, loss_fn, case.schedule, micro_batch=1, seq_len=SEQ // case.cp
    )
    losses, grads = [], {}
    for step in range(STEPS):
        x = batch(step)
        loss_fn.num_items = x[:, 1:].numel()  # label tokens of the whole step (every data rank's)
        inputs = target = x[dp_rank // case.cp :: batches]
        if cp_group is not None:  # this rank's slice of each sequence, the labels shifted before the cut
            part = context_parallel_batch(inputs, cp_group)
            inputs, target = part["input_ids"], part["shift_labels"]
        mb_losses = []
        if first:
            schedule.step(inputs)
        elif last:
            schedule.step(target=target, losses=mb_losses)
        else:
            schedule.step()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, update_rate=1e-2, group=replicas)
        if last:
            total = torch.stack([loss.detach() for loss in mb_losses]).sum()
            dist.all_reduce(total, group=replicas)
            losses.append(total.item() / dp)
    weights = {n: _full(p) for n, p in model.named_parameters()}
    weights.update({n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    clipped = opt.qk_clip.total_clipped_heads if getattr(opt, "qk_clip", None) else None
    if dp_rank == 0:
        torch.save(
            {
                "losses": losses,
                "grads": grads,
                "weights": weights,
                "clipped": clipped,
                "stage": pp_rank,
                "local_experts": local_experts,
            },
            os.path.join(out_dir, f"{case.name}.stage{pp_rank}.pt"),
        )
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.fsdp, args.fsdp), mesh_dim_names=("pp", "dp"))
    cases = EP_CASES if args.ep > 1 else FSDP_CASES if args.fsdp > 1 else CASES
    for case in cases:
        run_case(case, mesh, args.out_dir, args.ep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
