"""Kimi Delta Attention (KDA): public API, input checks, device dispatch and the PyTorch paths.

Per head, with a state S of shape [K, V] kept in fp32:

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)

`g_t` [K] is a per-channel log-decay (<= 0), `beta_t` one scalar per head and token. Checks that
read tensor values (g <= 0, cu_seqlens) run eagerly only, never under torch.compile / torch.export.

Paths (see `chunk_kda`'s `backend`):
- "reference": the plain token loop, one sequence at a time (ground truth for tests);
- "torch": an exact chunked algorithm built from batched matmuls (the CPU path; see
  `_chunk_torch`); `recurrent_kda` runs the token loop batched over sequences (decoding);
- "triton": the fused kernels of the optional `kimi_hf_kernels` package (CUDA).

The paths live beside this file (kda_inputs.py: norms, gate, checks; kda_recurrent.py: the token loop;
kda_chunk.py: the chunked algorithm), all in the flat, Hub-copyable model folder: torch only.
"""

from __future__ import annotations

import os
import warnings

import torch


try:  # optional accelerator (kimi_hf_kernels); loads without it
    from kimi_hf_kernels.kda import recurrent_kda as _triton_recurrent_kda
except ImportError:
    _triton_recurrent_kda = None
try:
    from kimi_hf_kernels.kda import chunk_kda as _triton_chunk_kda
    from kimi_hf_kernels.kda.common import MAX_HEAD_DIM as _TRITON_MAX_HEAD_DIM  # whole K, V rows per tile
except ImportError:
    _triton_chunk_kda, _TRITON_MAX_HEAD_DIM = None, 0

from .kda_chunk import CHUNK_SIZE, _chunk_torch
from .kda_inputs import _check_inputs, _compute_dtype, kda_gate, l2norm
from .kda_recurrent import _recurrent_torch, naive_recurrent_kda


__all__ = ["chunk_kda", "recurrent_kda", "naive_recurrent_kda", "l2norm", "kda_gate", "CHUNK_SIZE"]

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _select(backend, q, v, triton_impl, torch_impl):
    if backend == "reference":
        return naive_recurrent_kda
    if backend == "torch" or (backend is None and q.device.type != "cuda"):
        return torch_impl
    # "triton" forced, or a CUDA tensor with backend=None
    if triton_impl is None:
        _warn_once("no-triton", "kimi_hf: this Triton KDA kernel is not available; using the PyTorch path")
        return torch_impl
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {q.device}")
    if q.dtype == torch.float64:  # exact-arithmetic checks (gradcheck) run on the fp64 PyTorch path
        return torch_impl
    if max(q.shape[-1], v.shape[-1]) > _TRITON_MAX_HEAD_DIM:
        _warn_once(
            "head-dim",
            f"kimi_hf: the Triton KDA kernels take head dims up to {_TRITON_MAX_HEAD_DIM}; using the PyTorch path",
        )
        return torch_impl
    return triton_impl


def _run(
    impl,
    fused: bool,
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    use_qk_l2norm,
    use_gate_in_kernel,
    lower_bound,
    A_log,
    dt_bias,
    use_beta_sigmoid_in_kernel,
):
    """Calls an implementation; the gate activation and sigmoid(beta) are fused into the Triton
    kernels and applied here, in fp32 and differentiably, for the others. lower_bound (checked: None
    unless use_gate_in_kernel) selects the bounded K3 gate over Kimi-Linear's."""
    kw = dict(cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    lower_bound = None if lower_bound is None else float(lower_bound)
    if fused:
        kw.update(
            A_log=A_log if use_gate_in_kernel else None,
            dt_bias=dt_bias if use_gate_in_kernel else None,
            lower_bound=lower_bound,
            use_beta_sigmoid=use_beta_sigmoid_in_kernel,
        )
    else:
        if use_gate_in_kernel:
            g = kda_gate(g, A_log, None if dt_bias is None else dt_bias.reshape(-1), lower_bound=lower_bound)
        if use_beta_sigmoid_in_kernel:
            beta = torch.sigmoid(beta.to(_compute_dtype(q)))
    # autocast would turn the fp32 gate / state arithmetic's matmuls into bf16 halfway: the op picks its
    # own compute dtype from the inputs instead (meta tensors, which the memory planner traces, have no autocast)
    with torch.autocast(q.device.type if q.device.type != "meta" else "cpu", enabled=False):
        o, S = impl(q, k, v, g, beta, scale, initial_state, output_final_state, **kw)
    return o.to(q.dtype), S


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    backend=None,
    use_gate_in_kernel=False,
    safe_gate=False,
    lower_bound=None,
    A_log=None,
    dt_bias=None,
    use_beta_sigmoid_in_kernel=False,
):
    """Kimi Delta Attention over whole sequences (training, prefill).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H].
        g: [B, T, H, K] log-decay, every value <= 0 (the forget input f with use_gate_in_kernel=True:
            any value). CPU tensors are checked (ValueError). CUDA tensors are not (it would cost a host
            sync per call): there g > 0 or NaN gives non-finite outputs and states, silently.
        scale: query scale, default K ** -0.5.
        initial_state: [N, H, K, V] float32, N = B (or the number of sequences with cu_seqlens).
        output_final_state: also return the state after each sequence.
        cu_seqlens: [N + 1] integer offsets of packed sequences (FlashAttention convention; B must be 1).
        use_qk_l2norm: L2-normalise q and k per head in fp32 first.
        backend: None (by device: CUDA -> "triton", else "torch"), "torch", "reference" or "triton".
        use_gate_in_kernel: g is the raw forget input f; the decay (`kda_gate`, Kimi Linear's without a
            lower_bound) is computed inside, in fp32 (A_log [H], dt_bias [H * K] or None). fla's argument names.
        safe_gate: Kimi K3's bounded gate (fla's `safe_gate`; `kda_gate` with a lower_bound, in [lower_bound, 0];
            A_log may be None). Requires use_gate_in_kernel=True and lower_bound.
        lower_bound: the bound (a finite number < 0; K3 uses -5.0). As in fla, it is what selects the bounded
            gate: lower_bound without safe_gate gives the same gate; use_gate_in_kernel=True is required.
            (fla's chunk kernel also restricts it to [-5, 0) for its bounded fast path; ours take any bound.)
        use_beta_sigmoid_in_kernel: beta holds logits; sigmoid(beta) is computed inside.
    Returns:
        o [B, T, H, V] in q's dtype, and the final state [N, H, K, V] float32 (or None).
    """
    scale, _ = _check_inputs(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        cu_seqlens,
        backend,
        (use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound),
    )
    impl = _select(backend, q, v, _triton_chunk_kda, _chunk_torch)
    return _run(
        impl,
        impl is _triton_chunk_kda,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        use_gate_in_kernel,
        lower_bound,
        A_log,
        dt_bias,
        use_beta_sigmoid_in_kernel,
    )


def recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm=False,
    backend=None,
    use_gate_in_kernel=False,
    safe_gate=False,
    lower_bound=None,
    A_log=None,
    dt_bias=None,
    use_beta_sigmoid_in_kernel=False,
):
    """Kimi Delta Attention by the token loop: the decode path (one or a few tokens per call,
    state in and out). Same arguments and results as `chunk_kda`."""
    scale, _ = _check_inputs(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        cu_seqlens,
        backend,
        (use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound),
    )
    impl = _select(backend, q, v, _triton_recurrent_kda, _recurrent_torch)
    if (
        impl is _triton_recurrent_kda
        and torch.is_grad_enabled()
        and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    ):
        impl = _recurrent_torch  # the fused recurrent kernel is forward-only
    return _run(
        impl,
        impl is _triton_recurrent_kda,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        use_gate_in_kernel,
        lower_bound,
        A_log,
        dt_bias,
        use_beta_sigmoid_in_kernel,
    )
