"""Run by test_distributed.py under torchrun: train the tiny hybrid model (or, with "k3", a tiny Kimi K3) with
MuonClip on FSDP2 (torch's fully_shard, gloo on CPU) and save the full parameters from rank 0."""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from kimi_hf.optim import MuonClip, track_expert_load, update_expert_bias
from tests.optim.distributed_helpers import STEPS, batch, build, decoder_layers, qk_clip_tau


def main(out: str, arch: str = "hybrid"):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build(arch).train()
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    opt = MuonClip.from_model(model, lr=1e-2, qk_clip_tau=qk_clip_tau(arch))
    track_expert_load(model)  # expert balancing: the ranks' counts are summed, every rank applies one update
    for step in range(STEPS):
        x = batch(step)[rank::world]
        model(x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, update_rate=1e-2)
    full = {n: p.full_tensor().contiguous() for n, p in model.named_parameters()}
    full.update({n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    print(f"rank {rank}: clipped {opt.qk_clip.total_clipped_heads} heads", flush=True)
    if rank == 0:
        save_file(full, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
