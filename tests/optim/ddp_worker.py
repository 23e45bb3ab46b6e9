"""Run by test_distributed.py under torchrun: DDP as users start it (torch's DistributedDataParallel with its
default find_unused_parameters=False, gradient checkpointing on, as Trainer configures DDP then) on Kimi K3's
multimodal class with text-only batches, SGD with momentum and weight decay; saves the parameters from rank 0."""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

from tests.models.kimi_hybrid.helpers import train_losses
from tests.optim.distributed_helpers import STEPS, batch, build


def train(model, rank: int = 0, world: int = 1):
    # SGD: linear in the gradients, so the ranks' rounding stays at rounding level (Adam would divide it by ~0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    return train_losses(model, opt, [batch(step)[rank::world] for step in range(STEPS)])


def prepared(checkpointing: bool = True):
    torch.manual_seed(0)
    model = build("k3").train()
    if checkpointing:
        model.activation_checkpointing_enable()
    return model


def main(out: str):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = prepared()
    ddp = DistributedDataParallel(model)  # find_unused_parameters=False: every parameter must get a gradient
    losses = train(ddp, rank, world)
    print(f"rank {rank} of {world}: losses {losses}", flush=True)
    if rank == 0:
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
