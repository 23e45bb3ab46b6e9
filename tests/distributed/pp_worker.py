"""Run by test_pipeline.py under torchrun (gloo, CPU): train tiny Kimi K3 / Kimi Linear models on a pipeline of
torch.distributed.pipelining stages (PP 2, or PP 2 x FSDP2 2 on 4 ranks), and write what each rank holds: the
losses, the first step's gradients and the weights after the last step, by parameter name. `reference(case)` is
the same training in one process, the whole batch at once.

    python -m torch.distributed.run --nproc_per_node 2 pp_worker.py OUT_DIR [--fsdp 2]
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from kimi_hf.distributed import CausalLMLoss, KimiPipelineStageModule, PipelineStageInfo, build_schedule
from kimi_hf.distributed.pipeline import decoder_of, prune_to_stage
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


# K3: 4 layers, a block every 2 layers: [1, 3] puts the boundary inside a block, [2, 2] on a block edge
CASES = (
    Case("k3_gpipe_inside_block_muonclip", "k3", "gpipe", (1, 3), "muonclip"),
    Case("k3_1f1b_block_edge_adamw", "k3", "1f1b", (2, 2), "adamw"),
    Case("k3_1f1b_inside_block_adamw", "k3", "1f1b", (3, 1), "adamw"),
    Case("hybrid_1f1b_muonclip", "hybrid", "1f1b", None, "muonclip"),
    Case("hybrid_block_gpipe_adamw", "hybrid_block", "gpipe", (1, 3), "adamw"),
)
FSDP_CASES = (
    Case("k3_1f1b_fsdp_muonclip", "k3", "1f1b", (2, 2), "muonclip"),
    Case("hybrid_gpipe_fsdp_adamw", "hybrid", "gpipe", (1, 3), "adamw"),
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


def run_case(case: Case, mesh, out_dir: str) -> None:
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp, dp = mesh["pp"].size(), mesh["dp"].size()
    model = build(case.arch)
    layers = model.config.get_text_config().num_hidden_layers
    stage = PipelineStageInfo.split(layers, pp_rank, pp, case.split)
    prune_to_stage(model, stage)
    module = KimiPipelineStageModule(model, stage)
    if dp > 1:
        for i in stage.layers:
            fully_shard(decoder_of(model).layers[i], mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
    replicas = mesh["dp"].get_group()
    opt = optimizer(case, model, replicas)
    track_expert_load(model)
    n_micro = BATCH // dp  # one sequence a micro-batch
    loss_fn = CausalLMLoss(model.config.get_text_config().vocab_size, grad_divide=dp)
    schedule = build_schedule(
        module, stage, mesh["pp"].get_group(), n_micro, loss_fn, case.schedule, micro_batch=1, seq_len=SEQ
    )
    losses, grads = [], {}
    for step in range(STEPS):
        x = batch(step)
        loss_fn.num_items = x[:, 1:].numel()  # label tokens of the whole step (every data rank's)
        local = x[dp_rank::dp]
        mb_losses = []
        if stage.is_first:
            schedule.step(local)
        elif stage.is_last:
            schedule.step(target=local, losses=mb_losses)
        else:
            schedule.step()
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, update_rate=1e-2, group=replicas)
        if stage.is_last:
            total = torch.stack([loss.detach() for loss in mb_losses]).sum()
            dist.all_reduce(total, group=replicas)
            losses.append(total.item() / dp)
    weights = {n: _full(p) for n, p in model.named_parameters()}
    weights.update({n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    clipped = opt.qk_clip.total_clipped_heads if getattr(opt, "qk_clip", None) else None
    if dp_rank == 0:
        torch.save(
            {"losses": losses, "grads": grads, "weights": weights, "clipped": clipped, "stage": stage.index},
            os.path.join(out_dir, f"{case.name}.stage{stage.index}.pt"),
        )
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--fsdp", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.fsdp, args.fsdp), mesh_dim_names=("pp", "dp"))
    for case in FSDP_CASES if args.fsdp > 1 else CASES:
        run_case(case, mesh, args.out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
