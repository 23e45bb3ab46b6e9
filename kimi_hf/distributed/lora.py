"""LoRA adapters initialised the same whatever the layout: PEFT draws each lora_A from the global RNG in module
order, so a pipeline stage (which holds only some of the layers) would draw other values for the same adapter than
one process does. `init_lora_by_name` redraws every lora_A from a generator seeded by the seed and the adapter's
parameter name, with PEFT's own initialisation (Kaiming-uniform, a = sqrt(5); lora_B stays zero)."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn


@torch.no_grad()
def init_lora_by_name(model: nn.Module, seed: int) -> int:
    """Re-initialises each `lora_A.<adapter>.weight` of a PEFT model (before FSDP2 shards it) from
    Generator(seed, crc32(name)); returns how many it drew."""
    count = 0
    for name, p in model.named_parameters():
        if ".lora_A." in name and name.endswith(".weight"):
            gen = torch.Generator(device="cpu").manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
            fresh = torch.empty(p.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)
            p.copy_(fresh.to(p.dtype))
            count += 1
    return count


@torch.no_grad()
def average_unsharded_grads(model: nn.Module, group=None) -> int:
    """Averages over `group` (the data ranks) the gradients of the trainable parameters that FSDP2 does not manage:
    plain tensors, such as PEFT's adapters added to a model transformers had already sharded at load. FSDP2
    averages its own parameters' gradients the same way; one all-reduce of a flat buffer. Returns how many."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    grads = [g for g in grads if not isinstance(g, DTensor)]
    world = dist.get_world_size(group)
    if not grads or world == 1:
        return 0
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= world
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)


__all__ = ["average_unsharded_grads", "init_lora_by_name"]
