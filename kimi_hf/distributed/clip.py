"""Gradient clipping that is right on every layout: the norm of the whole model's gradient, whatever shards it.

torch's `clip_grad_norm_` takes DTensors on one mesh; a parallel Kimi model has several (FSDP2's data mesh,
the experts' own mesh under EP, transformers' tp mesh, PEFT's tensor-parallel adapters) and, under pipeline
parallelism, each rank holds only its stage. So (torchtitan's `clip_grad_norm_`, by mesh):
- the gradients are grouped by their device mesh; a DTensor group's norm is reduced over that mesh
  (`vector_norm` of a DTensor is a partial or replicated DTensor: `full_tensor()` sums the shards' squares once);
- plain tensors (replicated: PEFT's adapters added after the model was sharded, whose gradients are already averaged)
  count as they are on every rank;
- under pipeline parallelism the stages' squared norms are summed over `pipeline_group`.
Every rank then scales its own gradients by the same clip coefficient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.kimi_hybrid.modeling_kimi_hybrid_multimodal import _is_dtensor


@torch.no_grad()
def total_grad_norm(parameters, pipeline_group=None) -> torch.Tensor:
    """The L2 norm (fp32, a plain 0-dim tensor, the same on every rank) of all the gradients of `parameters` over
    the whole model."""
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[object, list] = {}
    plain = []
    for g in grads:
        (by_mesh.setdefault(g.device_mesh, []) if _is_dtensor(g) else plain).append(g)
    device = grads[0].device if grads else torch.device("cpu")
    square = torch.zeros((), dtype=torch.float32, device=device)
    for group in by_mesh.values():
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in group])
        norm = torch.linalg.vector_norm(norms)
        square += (norm.full_tensor() if _is_dtensor(norm) else norm).to(square.device) ** 2
    for g in plain:
        square += torch.linalg.vector_norm(g, dtype=torch.float32).to(square.device) ** 2
    if pipeline_group is not None:
        dist.all_reduce(square, group=pipeline_group)
    return square.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, pipeline_group=None) -> torch.Tensor:
    """Scales the gradients of `parameters` so that their whole-model norm is at most `max_norm` (as
    `torch.nn.utils.clip_grad_norm_`, eps 1e-6); returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = total_grad_norm(parameters, pipeline_group)
    coef = min(1.0, max_norm / (float(norm) + 1e-6))  # a float: a DTensor gradient scales by it locally
    if coef < 1.0:
        for p in parameters:
            p.grad.mul_(coef)
    return norm


__all__ = ["clip_grad_norm", "total_grad_norm"]
