"""Chunked KDA on Triton: the autograd Function around the kernels of chunk_fwd / chunk_bwd.

Saved for the backward: the inputs, G (fp32), X = (I + A)^-1 and P (fp32, [T, H, 64] each).
The backward recomputes W, U (from X), the per-chunk states and v'.
"""

from __future__ import annotations

import torch
import triton

from .chunk_bwd import intra_bwd_kernel, local_bwd_kernel, state_bwd_kernel, wy_bwd_kernel
from .chunk_fwd import gate_cumsum_kernel, output_kernel, scores_kernel, state_kernel, wy_kernel
from .common import CHUNK, INNER_BLOCK, MAX_HEAD_DIM, SUB, ChunkTables


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> contiguous [B * T, H, ...]."""
    return x.reshape(-1, *x.shape[2:]).contiguous()


def _operand_dtype(x: torch.Tensor) -> torch.dtype:
    """Stored dot operands (W, U, v', per-chunk states) keep 16-bit inputs' dtype, else fp32."""
    return x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float32


class _Meta:
    def __init__(self, tab, H, K, V, scale, l2norm, gate, lower_bound, beta_sigmoid):
        self.tab, self.H, self.K, self.V, self.scale = tab, H, K, V, scale
        # tl.dot needs every dimension >= 16
        self.BK, self.BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
        self.l2norm, self.gate, self.beta_sigmoid = l2norm, gate, beta_sigmoid
        # the safe gate (lower_bound set) or Kimi-Linear's; the kernels take a float either way
        self.safe_gate = lower_bound is not None
        self.lower_bound = float(lower_bound) if self.safe_gate else 0.0

    def gate_args(self, A_log, dt_bias):
        """The gate's arguments of `gate_cumsum_kernel` / `intra_bwd_kernel` (lower_bound is a runtime float)."""
        return dict(GATE=self.gate, SAFE_GATE=self.safe_gate, HAS_A=A_log is not None, HAS_BIAS=dt_bias is not None)

    def common(self):
        return dict(H=self.H, K=self.K, BT=CHUNK, BK=self.BK)


def _wy(m, q, k, v, beta, G, A, X):
    """W = X (beta e^G k), U = X (beta v); with A given, X = (I + A)^-1 is computed (and stored) first."""
    T, H, K, V, tab, dt = q.shape[0], m.H, m.K, m.V, m.tab, _operand_dtype(q)
    W = torch.empty(T, H, K, dtype=dt, device=q.device)
    U = torch.empty(T, H, V, dtype=dt, device=q.device)
    wy_kernel[(tab.num_chunks, H)](
        k,
        v,
        beta,
        G,
        A,
        X,
        W,
        U,
        tab.bos,
        tab.length,
        V=V,
        BC=SUB,
        BV=m.BV,
        L2NORM=m.l2norm,
        BETA_SIGMOID=m.beta_sigmoid,
        INVERT=A is not None,
        **m.common(),
    )
    return W, U


def _states(m, q, k, G, W, U, h0, want_final):
    """The sequential pass: the state entering every chunk, v' = U - W S, the final state."""
    T, H, K, V, tab, dt = q.shape[0], m.H, m.K, m.V, m.tab, _operand_dtype(q)
    hs = torch.empty(tab.num_chunks, H, K, V, dtype=dt, device=q.device)
    vnew = torch.empty(T, H, V, dtype=dt, device=q.device)
    ht = torch.empty(tab.N, H, K, V, dtype=torch.float32, device=q.device) if want_final else None
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), tab.N * H)  # noqa: E731
    state_kernel[grid](
        k,
        W,
        U,
        G,
        h0,
        hs,
        vnew,
        ht,
        tab.bos,
        tab.length,
        tab.seq,
        V=V,
        L2NORM=m.l2norm,
        USE_H0=h0 is not None,
        STORE_HT=want_final,
        **m.common(),
    )
    return hs, vnew, ht


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, h0, meta: _Meta, want_final: bool):
        T, H, K, V, tab = q.shape[0], meta.H, meta.K, meta.V, meta.tab
        new32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=q.device)  # noqa: E731
        G, A, P, X = new32(T, H, K), new32(T, H, CHUNK), new32(T, H, CHUNK), new32(T, H, CHUNK)
        grid = (tab.num_chunks, H)
        gate_cumsum_kernel[grid](
            g,
            A_log,
            dt_bias,
            G,
            tab.bos,
            tab.length,
            meta.lower_bound,
            **meta.gate_args(A_log, dt_bias),
            **meta.common(),
        )
        scores_kernel[grid](
            q,
            k,
            beta,
            G,
            A,
            P,
            tab.bos,
            tab.length,
            meta.scale,
            BC=SUB,
            L2NORM=meta.l2norm,
            BETA_SIGMOID=meta.beta_sigmoid,
            **meta.common(),
        )
        W, U = _wy(meta, q, k, v, beta, G, A, X)
        hs, vnew, ht = _states(meta, q, k, G, W, U, h0, want_final)
        del A, W, U  # the backward recomputes W, U from X and the states rather than keeping them
        o = torch.empty(T, H, V, dtype=q.dtype, device=q.device)
        out_grid = lambda m: (triton.cdiv(V, m["BV"]), tab.num_chunks, H)  # noqa: E731
        output_kernel[out_grid](
            q, G, P, hs, vnew, o, tab.bos, tab.length, meta.scale, V=V, L2NORM=meta.l2norm, **meta.common()
        )
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, G, X, P)
        ctx.meta = meta
        return o, ht

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, G, X, P = ctx.saved_tensors
        m = ctx.meta
        T, H, K, V, tab = q.shape[0], m.H, m.K, m.V, m.tab
        do = do.contiguous()  # autograd may hand over expanded (stride-0) gradients
        dht = dht.float().contiguous() if dht is not None else None
        W, U = _wy(m, q, k, v, beta, G, None, X)
        hs, vnew, _ = _states(m, q, k, G, W, U, h0, False)
        del U
        new32 = lambda *s: torch.empty(*s, dtype=torch.float32, device=q.device)  # noqa: E731
        dhs, dvnew = new32(tab.num_chunks, H, K, V), new32(T, H, V)
        dh0 = new32(tab.N, H, K, V) if h0 is not None else None
        grid = lambda meta: (triton.cdiv(V, meta["BV"]), tab.N * H)  # noqa: E731
        state_bwd_kernel[grid](
            q,
            k,
            G,
            W,
            P,
            do,
            dht,
            dh0,
            dhs,
            dvnew,
            tab.bos,
            tab.length,
            tab.seq,
            m.scale,
            V=V,
            L2NORM=m.l2norm,
            USE_DHT=dht is not None,
            STORE_DH0=dh0 is not None,
            **m.common(),
        )
        dq1, dk1, dG1, dW, dP = new32(T, H, K), new32(T, H, K), new32(T, H, K), new32(T, H, K), new32(T, H, CHUNK)
        cgrid = (tab.num_chunks, H)
        local_bwd_kernel[(tab.num_chunks, H, triton.cdiv(K, INNER_BLOCK))](
            q,
            k,
            G,
            hs,
            dhs,
            vnew,
            dvnew,
            do,
            dq1,
            dk1,
            dG1,
            dW,
            dP,
            tab.bos,
            tab.length,
            m.scale,
            H=H,
            K=K,
            V=V,
            BT=CHUNK,
            BKB=INNER_BLOCK,
            BV=INNER_BLOCK,
            L2NORM=m.l2norm,
        )
        dk2, dG2, dA, dbeta2 = new32(T, H, K), new32(T, H, K), new32(T, H, CHUNK), new32(T, H)
        dv = torch.empty_like(v)
        wy_bwd_kernel[cgrid](
            k,
            v,
            beta,
            G,
            X,
            dW,
            dvnew,
            dk2,
            dG2,
            dv,
            dbeta2,
            dA,
            tab.bos,
            tab.length,
            H=H,
            K=K,
            V=V,
            BT=CHUNK,
            BKB=INNER_BLOCK,
            BV=INNER_BLOCK,
            L2NORM=m.l2norm,
            BETA_SIGMOID=m.beta_sigmoid,
        )
        dq, dk, dg, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(g), torch.empty_like(beta)
        dA_log = new32(tab.num_chunks, H) if A_log is not None else None  # per chunk, summed below
        intra_bwd_kernel[cgrid](
            q,
            k,
            g,
            beta,
            A_log,
            dt_bias,
            G,
            dA,
            dP,
            dq1,
            dk1,
            dG1,
            dk2,
            dG2,
            dbeta2,
            dq,
            dk,
            dg,
            dbeta,
            dA_log,
            tab.bos,
            tab.length,
            m.scale,
            m.lower_bound,
            BC=SUB,
            L2NORM=m.l2norm,
            BETA_SIGMOID=m.beta_sigmoid,
            **m.gate_args(A_log, dt_bias),
            **m.common(),
        )
        d_alog = d_bias = None
        if m.gate:
            if A_log is not None:  # optional with the safe gate
                d_alog = dA_log.sum(0).to(A_log.dtype)
            # dt_bias enters as f + dt_bias (either gate): its gradient is df summed over tokens
            if dt_bias is not None:
                d_bias = dg.float().sum(0).reshape(-1).to(dt_bias.dtype)
        return dq, dk, dv, dg, dbeta, d_alog, d_bias, dh0, None, None


def chunk_kda(
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
    """Chunked KDA (forward and backward on Triton), same contract as kimi_hf.ops.chunk_kda's
    implementations (inputs already checked): q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K]
    (the log-decay, or the raw forget projection f when A_log or lower_bound is given: the gate is then
    computed inside, in fp32, and differentiated there too: `common.gate_fwd` / `gate_bwd`, with lower_bound < 0
    Kimi K3's safe gate, A_log optional); A_log [H]; dt_bias [H * K] or None; beta [B, T, H] (logits when use_beta_sigmoid);
    initial_state [N, H, K, V] fp32 or None. K and V up to 256.
    Returns o [B, T, H, V] in q's dtype and the final state [N, H, K, V] fp32 (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"the Triton KDA kernels take head dims up to {MAX_HEAD_DIM}, got K={K}, V={V}")
    tab = ChunkTables(B, T, cu_seqlens, q.device)
    gate = A_log is not None or lower_bound is not None
    meta = _Meta(tab, H, K, V, float(scale), bool(use_qk_l2norm), gate, lower_bound, bool(use_beta_sigmoid))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, ht = ChunkKDAFunction.apply(
        _flat(q),
        _flat(k),
        _flat(v),
        _flat(g),
        _flat(beta),
        A_log.contiguous() if A_log is not None else None,
        dt_bias.contiguous() if dt_bias is not None else None,
        h0,
        meta,
        bool(output_final_state),
    )
    return o.view(B, T, H, V), ht
