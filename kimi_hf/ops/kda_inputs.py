"""Kimi Delta Attention: what is done to the inputs before any path runs (the q/k L2 norm, the gate
`kda_gate` (the one statement of the gate formulas on the PyTorch side; the Triton side's is kimi_hf_kernels/kda/common.py
`gate_fwd`), the casts to the compute dtype) and the input checks.

Part of the flat, Hub-copyable model folder: torch only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


BACKENDS = (None, "torch", "reference", "triton")


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the fla / transformers form, not F.normalize)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """KDA's per-channel log-decay g [B, T, H, K], in fp32 (fp64 for fp64 f, as the rest of the op):

    - lower_bound None (Kimi-Linear): g = -exp(A_log[h]) * softplus(f + dt_bias), in (-inf, 0];
    - lower_bound < 0 (Kimi K3's "safe gate", fla's `safe_gate=True, lower_bound=...`):
      g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)), in [lower_bound, 0]; A_log may be None
      (then exp(A_log) is 1, as in fla).

    f: [B, T, H, K] (the low-rank forget projection); A_log: [H] (required without lower_bound);
    dt_bias: [H * K] (or [H, K]) or None. Order as in fla and the K3 release: dt_bias is added to f first,
    then the per-head scale exp(A_log), then the activation. softplus is linear above 20 (torch's
    threshold, as in fla and transformers). Kimi-Linear was trained without a lower bound, so its g can be
    very negative; the safe gate bounds every step's decay to at least exp(lower_bound).
    """
    H, K = f.shape[-2:]
    x = f.to(torch.float64 if f.dtype == torch.float64 else torch.float32)
    if dt_bias is not None:
        x = x + dt_bias.to(x.dtype).view(H, K)
    if lower_bound is None:
        if A_log is None:
            raise ValueError("kda_gate: A_log is required for the gate without a lower_bound")
        return -A_log.to(x.dtype).exp().view(H, 1) * F.softplus(x)
    if A_log is not None:
        x = A_log.to(x.dtype).exp().view(H, 1) * x
    return float(lower_bound) * torch.sigmoid(x)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------
def _values_unknown(x: torch.Tensor) -> bool:
    """Whether x's values cannot be read: under torch.compile / torch.export (dynamo and non-strict),
    torch.jit tracing or fake tensors. Checks that read values (`.tolist()`, `bool(tensor)`) are
    skipped there: they would break the graph, or fail on data-dependent guards."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # first: dynamo must not trace is_fake
        return True
    return _is_fake(x) or x.device.type == "meta"


def _is_fake(x: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # a torch without fake tensors
        return False
    return is_fake(x)


def _check_fusions(q, gate_args) -> None:
    """Checks the fused gate's arguments (use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound):
    A_log [H], dt_bias [H * K] (or [H, K]) and the safe gate's lower bound.

    Semantics (fla's): with use_gate_in_kernel=True, lower_bound selects the gate (`kda_gate`): None gives
    Kimi-Linear's (A_log required), a number < 0 Kimi K3's bounded safe gate (A_log optional). safe_gate=True asks for the bounded gate
    and so requires lower_bound; lower_bound alone gives the same gate (in fla, too, the formula follows
    lower_bound, and safe_gate additionally picks its bounded-gate kernel path). Without use_gate_in_kernel,
    g is already the log-decay: A_log, dt_bias, safe_gate and lower_bound are refused.
    """
    use_gate, A_log, dt_bias, safe_gate, lower_bound = gate_args
    H, K = q.shape[2:]
    if not use_gate:
        if safe_gate or lower_bound is not None:
            name = "safe_gate=True" if safe_gate else "lower_bound"
            raise ValueError(
                f"{name} requires use_gate_in_kernel=True (the bounded gate is computed inside from the raw "
                "forget input g)"
            )
        if A_log is not None or dt_bias is not None:
            raise ValueError(
                "A_log and dt_bias are only used with use_gate_in_kernel=True (g is then the raw forget input)"
            )
        return
    if safe_gate and lower_bound is None:
        raise ValueError("safe_gate=True needs a lower_bound < 0 (Kimi K3 uses -5.0): g = lower_bound * sigmoid(...)")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"lower_bound must be a number (float), got {type(lower_bound).__name__}")
        # < 0: the bounded gate is then a decay (g <= 0), which the chunked paths need
        if not math.isfinite(lower_bound) or lower_bound >= 0:
            raise ValueError(f"lower_bound must be a finite number < 0 (Kimi K3 uses -5.0), got {lower_bound!r}")
    for name, x, shapes in (("A_log", A_log, [(H,)]), ("dt_bias", dt_bias, [(H * K,), (H, K)])):
        if x is None and (name == "dt_bias" or lower_bound is not None):  # the bounded gate works without A_log
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor with use_gate_in_kernel=True, got {type(x).__name__}")
        if tuple(x.shape) not in shapes or not x.is_floating_point() or x.device != q.device:
            raise ValueError(
                f"{name} must be a floating-point tensor of shape {' or '.join(map(str, map(list, shapes)))} "
                f"on {q.device}, got {x.dtype} {list(x.shape)} on {x.device}"
            )


def _check_inputs(
    q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, gate_args=(False, None, None, False, None)
) -> tuple[float, int]:
    """Validates the public arguments; returns (scale, number of sequences N). gate_args: (use_gate_in_kernel,
    A_log, dt_bias, safe_gate, lower_bound), see `_check_fusions`."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if q.ndim != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T == 0:
        raise ValueError("q has an empty time dimension (T = 0)")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)} (per-channel decay), got {tuple(g.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must have shape [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if scale is None:
        scale = K**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")

    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor [N + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
            )
        if B != 1:
            raise ValueError(f"cu_seqlens requires packed inputs with batch size 1, got B = {B}")
        N = cu_seqlens.numel() - 1
        if not _values_unknown(cu_seqlens):
            cu = cu_seqlens.tolist()
            if cu[0] != 0 or cu[-1] != T:
                raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {cu[0]} ... {cu[-1]}")
            if any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError("cu_seqlens must be non-decreasing")
    _check_fusions(q, gate_args)
    # g > 0 grows the state and overflows the chunk path's exponentials (it assumes G non-increasing):
    # refused where the check is cheap (CPU; on CUDA it would be a host sync per call). With
    # use_gate_in_kernel, g is the raw forget input and any value is valid.
    if not gate_args[0] and g.device.type == "cpu" and g.numel() and not _values_unknown(g):
        top = g.detach().max().item()  # a reduction, no [B, T, H, K] temporary; NaN propagates
        if not top <= 0:
            raise ValueError(
                f"g must be a log-decay (every value <= 0, no NaN), got a maximum of {top}; pass raw "
                "forget inputs with use_gate_in_kernel=True, or compute g with kda_gate"
            )
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        want = (N, H, K, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(
                f"initial_state must have shape [N, H, K, V] = {list(want)}, got {list(initial_state.shape)}"
            )
        # fp64 states are accepted with fp64 inputs only (exact-arithmetic checks such as gradcheck).
        if initial_state.dtype != torch.float32 and not (initial_state.dtype == torch.float64 == q.dtype):
            raise ValueError(f"initial_state must be float32, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return float(scale), N


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """Everything runs in fp32, or in fp64 when the inputs are fp64."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Casts to the compute dtype, applies the optional q/k L2 norm and the scale (in that order)."""
    dt = _compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k, v, g, beta
