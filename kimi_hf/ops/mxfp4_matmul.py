"""The routed experts' grouped matmul with weights kept in MXFP4 (Kimi K3's released format, `mxfp4.py`).

For rows of x grouped by expert (counts[e] consecutive rows for expert e, e = 0 .. E - 1):

    y[rows of e] = x[rows of e] @ W_e^T,   W_e = dequantize_mxfp4(packed[e], scale[e])  [out, in]

x [S, in] (S = sum(counts)), packed [E, out, in / 2] uint8, scale [E, out, in / 32] uint8 -> y [S, out] in x's dtype.
The weights are frozen bytes: the backward returns the input gradient only, dx[rows of e] = dy[rows of e] @ W_e
(what LoRA adapters before and after the experts need), and saves no activation for it (just the bytes' handles).

Paths (`backend`):
- "torch" (CPU, and CUDA without the kernel): one expert at a time, only experts with rows, dequantised into the
  activations' dtype (exact: every MXFP4 value is a bf16 / fp32 number, see `dequantize_mxfp4`) and multiplied
  with F.linear, exactly as the dense experts multiply; at most one expert's dense weight exists at a time.
- "triton" (`kimi_hf_kernels.mxfp4`, CUDA; on CPU under TRITON_INTERPRET=1 for tests): tiles of W decoded in
  registers from the packed bytes and their scales (the MX block of 32 along the forward's reduction dim), never
  written out.
"auto" takes "triton" for CUDA tensors when the kernel imports, else "torch": never a crash on a device without it.

Part of the flat, Hub-copyable model folder: torch only (the kernel is an optional import).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .mxfp4 import dequantize_mxfp4


try:  # optional accelerator (kimi_hf_kernels); everything runs without it
    from kimi_hf_kernels.mxfp4 import mxfp4_grouped_matmul as _triton_matmul
except ImportError:
    _triton_matmul = None

BACKENDS = ("auto", "torch", "triton")


def _torch_matmul(x: torch.Tensor, packed, scale, counts: list[int], transpose: bool) -> torch.Tensor:
    """x [S, in] -> [S, out] (transpose=False: x @ W_e^T) or x [S, out] -> [S, in] (transpose=True: x @ W_e)."""
    width = packed.shape[1] if not transpose else 2 * packed.shape[2]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            w = dequantize_mxfp4(packed[e], scale[e], dtype=x.dtype)  # [out, in], this expert only
            seg = x[start : start + n]
            outs.append(seg @ w if transpose else F.linear(seg, w))
            start += n
    return torch.cat(outs) if outs else x.new_zeros(0, width)


def _resolve(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.is_cuda and _triton_matmul is not None else "torch"
    if backend == "triton":
        if _triton_matmul is None:
            raise ValueError("backend='triton': kimi_hf_kernels is not installed")
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return backend


def _matmul(x, packed, scale, counts, transpose, backend):
    if x.is_meta:  # shapes only (the memory planner's trace, kimi_hf/plan): no expert is dequantised
        return x.new_empty(x.shape[0], packed.shape[1] if not transpose else 2 * packed.shape[2])
    if backend == "triton":
        return _triton_matmul(x, packed, scale, counts, transpose=transpose)
    return _torch_matmul(x, packed, scale, counts, transpose)


class _Mxfp4GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, scale, counts, backend):
        ctx.save_for_backward(packed, scale)
        ctx.counts, ctx.backend = counts, backend
        return _matmul(x, packed, scale, counts, False, backend)

    @staticmethod
    def backward(ctx, dy):
        packed, scale = ctx.saved_tensors
        dx = (
            _matmul(dy.contiguous(), packed, scale, ctx.counts, True, ctx.backend) if ctx.needs_input_grad[0] else None
        )
        return dx, None, None, None, None


def mxfp4_grouped_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, counts, backend: str = "auto"
) -> torch.Tensor:
    """x [S, in] (rows grouped by expert, counts[e] of expert e), packed [E, out, in / 2] uint8, scale
    [E, out, in / 32] uint8 -> [S, out] in x's dtype: each group times its expert's MXFP4 weight, transposed.
    Differentiable in x (not in the bytes). counts: E ints (a list, or a tensor read once on the host)."""
    counts = [int(n) for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"packed / scale must be uint8 MXFP4 bytes, got {packed.dtype} / {scale.dtype}")
    if packed.dim() != 3 or scale.shape[:2] != packed.shape[:2] or scale.shape[2] * 16 != packed.shape[2]:
        raise ValueError(
            f"packed {tuple(packed.shape)} / scale {tuple(scale.shape)} must be [E, out, in / 2] / [E, out, in / 32]"
        )
    if x.dim() != 2 or x.shape[1] != 2 * packed.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} must be [S, in = {2 * packed.shape[2]}]")
    if len(counts) != packed.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(f"counts must be {packed.shape[0]} non-negative row counts summing to {x.shape[0]}")
    return _Mxfp4GroupedLinear.apply(x, packed, scale, counts, _resolve(backend, x))


__all__ = ["BACKENDS", "mxfp4_grouped_linear"]
