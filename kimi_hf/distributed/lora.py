"""LoRA adapters initialised the same whatever the layout: PEFT draws each lora_A from the global RNG in module
order, so a pipeline stage (which holds only some of the layers) would draw other values for the same adapter than
one process does. `init_lora_by_name` redraws every lora_A from a generator seeded by the seed and the adapter's
parameter name, with PEFT's own initialisation (Kaiming-uniform, a = sqrt(5); lora_B stays zero).

Under tensor parallelism PEFT shards the adapters of colwise / rowwise layers as DTensors over the "tp" mesh (B by
output rows, A by input columns): each rank then takes its slice of the same full draw, and their gradients, which
no data-parallel engine manages, are averaged over the data ranks here like the plain adapters'."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from ..models.kimi_hybrid.modeling_kimi_hybrid_multimodal import _is_dtensor


@torch.no_grad()
def init_lora_by_name(model: nn.Module, seed: int) -> int:
    """Re-initialises each `lora_A.<adapter>.weight` of a PEFT model (before FSDP2 shards it; tensor-parallel
    DTensor adapters are filled slice by slice) from Generator(seed, crc32(name)); returns how many it drew."""
    count = 0
    for name, p in model.named_parameters():
        if ".lora_A." in name and name.endswith(".weight"):
            gen = torch.Generator(device="cpu").manual_seed((seed << 32) ^ zlib.crc32(name.encode()))
            fresh = torch.empty(p.shape, dtype=torch.float32)  # a DTensor's shape is the global one
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=gen)
            fresh = fresh.to(p.dtype)
            if _is_dtensor(p):  # every rank drew the same tensor: slice it locally, no communication
                from torch.distributed.tensor import distribute_tensor

                fresh = distribute_tensor(fresh, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(fresh)
            count += 1
    return count


def _data_parallel_engine_grad(grad) -> bool:
    """A gradient FSDP2 reduces itself: a DTensor on a mesh with a data dimension ("fsdp", "dp_replicate", or
    FSDP2's unnamed mesh); a DTensor only over "tp" (PEFT's tensor-parallel adapters) is not one."""
    if not _is_dtensor(grad):
        return False
    names = grad.device_mesh.mesh_dim_names or ()
    return not names or any(n != "tp" for n in names)


@torch.no_grad()
def average_unsharded_grads(model: nn.Module, group=None) -> int:
    """Averages over `group` (the data ranks: under tensor parallelism, the ranks of the same tp coordinate) the
    gradients of the trainable parameters that FSDP2 does not manage: plain tensors, such as PEFT's adapters added to
    a model transformers had already sharded at load, and PEFT's tensor-parallel adapters (DTensors over "tp" only:
    each rank's local slice is averaged with the same slice of the other data ranks). FSDP2 averages its own
    parameters' gradients the same way; one all-reduce of a flat buffer. Returns how many."""
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    grads = [g.to_local() if _is_dtensor(g) else g for g in grads if not _data_parallel_engine_grad(g)]
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
