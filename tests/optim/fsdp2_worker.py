"""Run by test_distributed.py under torchrun: train the tiny hybrid model (or, with "k3", a tiny Kimi K3) with
MuonClip on FSDP2 (torch's fully_shard, gloo on CPU) and save the full parameters from rank 0."""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from kimi_hf.optim import MuonClip
from tests.optim.test_distributed import STEPS, batch, build, decoder_layers, qk_clip_tau


def main(out: str, arch: str = "hybrid"):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build(arch).train()
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    opt = MuonClip.from_model(model, lr=1e-2, qk_clip_tau=qk_clip_tau(arch))
    for step in range(STEPS):
        x = batch(step)[rank::world]
        model(x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
    full = {n: p.full_tensor().contiguous() for n, p in model.named_parameters()}
    print(f"rank {rank}: clipped {opt.qk_clip.total_clipped_heads} heads", flush=True)
    if rank == 0:
        save_file(full, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
