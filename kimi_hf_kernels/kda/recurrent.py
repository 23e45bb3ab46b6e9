"""Fused recurrent KDA forward (decoding: few tokens per call, state in and out).

One program per (value block, sequence, head) keeps its [K, BV] slice of the state in registers, in
fp32, and walks the tokens: S <- S * exp(g_t); S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.
The whole K dimension is in the block, so the optional q/k L2 norm (x / sqrt(sum x^2 + 1e-6)) is
fused in, as are the gate activation (`common.gate_fwd`: Kimi Linear's gate or Kimi K3's safe gate) and
sigmoid(beta).
Forward only: kimi_hf's dispatcher uses the PyTorch path when gradients are needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import configs, gate_fwd, gate_scale


@triton.autotune(configs=configs({"BV": (16, 32, 64)}, {"BV": 32}), key=["K", "V", "L2NORM", "SAFE_GATE"])
@triton.jit
def _recurrent_kda_fwd(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    o,
    h0,
    ht,
    cu_seqlens,
    scale,
    lower_bound,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    VARLEN: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = (i_n * T).to(tl.int64)
        eos = bos + T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    p_state = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    if USE_H0:
        S += tl.load(h0 + p_state, mask=m_kv, other=0.0).to(tl.float32)
    if GATE:
        a = gate_scale(A_log, i_h, HAS_A)
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        row = t * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + row).to(tl.float32)
        if BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)
        if GATE:
            if HAS_BIAS:
                b_g += bias
            b_g = gate_fwd(b_g, a, lower_bound, SAFE_GATE)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        S = S * tl.exp(b_g)[:, None]
        delta = b_beta * (b_v - tl.sum(b_k[:, None] * S, 0))
        S += b_k[:, None] * delta[None, :]
        b_o = tl.sum((b_q * scale)[:, None] * S, 0)
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_HT:
        tl.store(ht + p_state, S, mask=m_kv)


def recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens=None,
    use_qk_l2norm=False,
    A_log=None,
    dt_bias=None,
    use_beta_sigmoid=False,
    lower_bound=None,
):
    """Same contract as kimi_hf.ops.recurrent_kda's implementations (inputs already checked):
    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [N, H, K, V] fp32 or None.
    With A_log or lower_bound, g is the raw forget input f (A_log [H], dt_bias [H * K] or None) and the gate
    (`common.gate_fwd`; with lower_bound < 0 the safe gate, A_log optional) is applied inside; with
    use_beta_sigmoid, beta holds logits.
    Returns o [B, T, H, V] in q's dtype and the final state [N, H, K, V] fp32 (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(B, T, H, V, dtype=q.dtype, device=q.device)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * H)  # noqa: E731
    _recurrent_kda_fwd[grid](
        q,
        k,
        v,
        g,
        beta,
        A_log,
        None if dt_bias is None else dt_bias.contiguous(),
        o,
        h0,
        ht,
        cu_seqlens,
        scale,
        0.0 if lower_bound is None else float(lower_bound),
        T,
        H=H,
        K=K,
        V=V,
        BK=triton.next_power_of_2(K),
        USE_H0=h0 is not None,
        STORE_HT=ht is not None,
        VARLEN=cu_seqlens is not None,
        L2NORM=use_qk_l2norm,
        GATE=A_log is not None or lower_bound is not None,
        SAFE_GATE=lower_bound is not None,
        HAS_A=A_log is not None,
        HAS_BIAS=dt_bias is not None,
        BETA_SIGMOID=use_beta_sigmoid,
    )
    return o, ht
