"""Chunked KDA forward kernels (the WY / UT-transform chunking of DeltaNet and Kimi Linear, arXiv 2510.26692), one launch per stage:

1. `gate_cumsum`: G = chunk-local cumsum of g, in fp32 (the gate fused in when asked: `common.gate_fwd`,
   Kimi-Linear's gate or Kimi K3's safe gate).
2. `scores`: per chunk, A = Diag(beta) tril_-1(A_kk) and P = tril(A_qk) (q scaled), sub-chunk by
   sub-chunk with anchored exponents: for a block (i, j < i) every row carries exp(G_r - G_n) <= 1
   and every column exp(G_n - G_c) <= 1, with n the first row of sub-chunk i; diagonal blocks are
   built column by column with exp(G_r - G_c), r >= c.
3. `wy`: X = (I + A)^-1 by block forward substitution (16 x 16 blocks), W = X (beta e^G k),
   U = X (beta v).
4. `state`: the only sequential stage: for each chunk, store the state S entering it,
   v' = U - W S, S <- e^{G_last} S + (e^{G_last - G} k)^T v'.
5. `output`: o = (q e^G) S + P v', parallel over chunks.
Accumulation is fp32 throughout; the stored operands of later dots (W, U, v', S) use the input
dtype when it is 16-bit, as the inputs themselves do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    configs,
    gate_fwd,
    gate_scale,
    load_beta,
    load_block,
    load_cumgate,
    load_cumgate_row,
    load_qk,
    load_rows,
    state_ptrs,
    store_block,
    store_rows,
)


@triton.autotune(configs=configs({}), key=["H", "K", "GATE", "SAFE_GATE"])
@triton.jit
def gate_cumsum_kernel(
    g,
    A_log,
    dt_bias,
    G,
    chunk_bos,
    chunk_len,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    x = load_rows(g, bos, n, i_h, 0, H, K, BT, BK)
    if GATE:
        d = tl.arange(0, BK)
        if HAS_BIAS:
            x += tl.load(dt_bias + i_h * K + d, mask=d < K, other=0.0).to(tl.float32)[None, :]
        x = gate_fwd(x, gate_scale(A_log, i_h, HAS_A), lower_bound, SAFE_GATE)
        # rows past the chunk read f = 0, whose gate is not 0: they must not enter the cumsum's padding
        x = tl.where((tl.arange(0, BT) < n)[:, None], x, 0.0)
    store_rows(G, tl.cumsum(x, 0), bos, n, i_h, 0, H, K, BT, BK)


@triton.jit
def _diag_scores(q_i, k_i, G_i, BC: tl.constexpr):
    """Diagonal sub-block: a[r, c] = sum_d k_r k_c exp(G_r - G_c) for r > c and
    p[r, c] = sum_d q_r k_c exp(G_r - G_c) for r >= c, column by column (every exponent <= 0)."""
    r = tl.arange(0, BC)
    a = tl.zeros([BC, BC], dtype=tl.float32)
    p = tl.zeros([BC, BC], dtype=tl.float32)
    for c in range(BC):
        k_c = tl.sum(tl.where(r[:, None] == c, k_i, 0.0), 0)
        G_c = tl.sum(tl.where(r[:, None] == c, G_i, 0.0), 0)
        e = tl.exp(tl.where(r[:, None] >= c, G_i - G_c[None, :], float("-inf"))) * k_c[None, :]
        a = tl.where((r[:, None] > c) & (r[None, :] == c), tl.sum(k_i * e, 1)[:, None], a)
        p = tl.where((r[:, None] >= c) & (r[None, :] == c), tl.sum(q_i * e, 1)[:, None], p)
    return a, p


@triton.autotune(configs=configs({}), key=["H", "K", "L2NORM"])
@triton.jit
def scores_kernel(
    q,
    k,
    beta,
    G,
    A,
    P,
    chunk_bos,
    chunk_len,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    # runtime loops over sub-chunks (not unrolled): small code, low register pressure
    for i in range(BT // BC):
        t_i, n_i = bos + i * BC, n - i * BC
        q_i = load_qk(q, t_i, n_i, i_h, H, K, BC, BK, L2NORM) * scale
        k_i = load_qk(k, t_i, n_i, i_h, H, K, BC, BK, L2NORM)
        G_i = load_cumgate(G, t_i, n_i, i_h, H, K, BC, BK)
        b_i = load_beta(beta, t_i, n_i, i_h, H, BC, BETA_SIGMOID)
        G_n = load_cumgate_row(G, bos + tl.minimum(i * BC, n - 1), i_h, 0, H, K, BK)  # the anchor
        E_i = tl.exp(G_i - G_n[None, :])
        for j in range(i):
            k_j = load_qk(k, bos + j * BC, n - j * BC, i_h, H, K, BC, BK, L2NORM)
            c_j = k_j * tl.exp(G_n[None, :] - load_cumgate(G, bos + j * BC, n - j * BC, i_h, H, K, BC, BK))
            store_block(A, tl.dot(k_i * E_i, tl.trans(c_j)) * b_i[:, None], t_i, n_i, i_h, j * BC, H, BT, BC, BC)
            store_block(P, tl.dot(q_i * E_i, tl.trans(c_j)), t_i, n_i, i_h, j * BC, H, BT, BC, BC)
        a, p = _diag_scores(q_i, k_i, G_i, BC)
        store_block(A, a * b_i[:, None], t_i, n_i, i_h, i * BC, H, BT, BC, BC)
        store_block(P, p, t_i, n_i, i_h, i * BC, H, BT, BC, BC)
        for j in range(i + 1, BT // BC):
            store_block(A, tl.zeros([BC, BC], dtype=tl.float32), t_i, n_i, i_h, j * BC, H, BT, BC, BC)
            store_block(P, tl.zeros([BC, BC], dtype=tl.float32), t_i, n_i, i_h, j * BC, H, BT, BC, BC)


@triton.jit
def _unit_lower_inverse(a, BC: tl.constexpr):
    """(I + a)^-1 for a strictly lower-triangular [BC, BC] block, row by row:
    x_i = e_i - sum_{j < i} a_ij x_j."""
    r = tl.arange(0, BC)
    x = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in range(1, BC):
        a_i = tl.sum(tl.where(r[:, None] == i, a, 0.0), 0)
        x = tl.where(r[:, None] == i, x - tl.sum(a_i[:, None] * x, 0)[None, :], x)
    return x


@triton.autotune(configs=configs({}), key=["H", "K", "V", "INVERT"])
@triton.jit
def wy_kernel(
    k,
    v,
    beta,
    G,
    A,
    X,
    W,
    U,
    chunk_bos,
    chunk_len,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
    INVERT: tl.constexpr,
):
    """X = (I + A)^-1 (when INVERT; otherwise X is read), then W = X (beta e^G k), U = X (beta v)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    NS: tl.constexpr = BT // BC
    if INVERT:
        # block forward substitution: X_ij = -X_ii sum_{j <= m < i} A_im X_mj, row block by row block
        for i in range(NS):
            t_i, n_i = bos + i * BC, n - i * BC
            x_ii = _unit_lower_inverse(load_block(A, t_i, n_i, i_h, i * BC, H, BT, BC, BC), BC)
            store_block(X, x_ii, t_i, n_i, i_h, i * BC, H, BT, BC, BC)
            for j in range(i):
                acc = tl.zeros([BC, BC], dtype=tl.float32)
                for m in range(j, i):
                    acc += tl.dot(
                        load_block(A, t_i, n_i, i_h, m * BC, H, BT, BC, BC),
                        load_block(X, bos + m * BC, n - m * BC, i_h, j * BC, H, BT, BC, BC),
                        input_precision="tf32x3",
                    )
                store_block(X, -tl.dot(x_ii, acc, input_precision="tf32x3"), t_i, n_i, i_h, j * BC, H, BT, BC, BC)
            for j in range(i + 1, NS):
                store_block(X, tl.zeros([BC, BC], dtype=tl.float32), t_i, n_i, i_h, j * BC, H, BT, BC, BC)
            tl.debug_barrier()  # the next row blocks read this one's X from memory
    for i in range(NS):
        t_i, n_i = bos + i * BC, n - i * BC
        w = tl.zeros([BC, BK], dtype=tl.float32)
        u = tl.zeros([BC, BV], dtype=tl.float32)
        for j in range(i + 1):
            t_j, n_j = bos + j * BC, n - j * BC
            x_ij = load_block(X, t_i, n_i, i_h, j * BC, H, BT, BC, BC)
            b_j = load_beta(beta, t_j, n_j, i_h, H, BC, BETA_SIGMOID)[:, None]
            k_j = load_qk(k, t_j, n_j, i_h, H, K, BC, BK, L2NORM)
            G_j = load_cumgate(G, t_j, n_j, i_h, H, K, BC, BK)
            w += tl.dot(x_ij, b_j * tl.exp(G_j) * k_j)
            u += tl.dot(x_ij, b_j * load_rows(v, t_j, n_j, i_h, 0, H, V, BC, BV))
        store_rows(W, w, t_i, n_i, i_h, 0, H, K, BC, BK)
        store_rows(U, u, t_i, n_i, i_h, 0, H, V, BC, BV)


@triton.autotune(configs=configs({"BV": (32, 64)}, {"BV": 32}), key=["H", "K", "V"])
@triton.jit
def state_kernel(
    k,
    W,
    U,
    G,
    h0,
    hs,
    vnew,
    ht,
    chunk_bos,
    chunk_len,
    seq_chunks,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
):
    """One program per (value block, sequence, head) walks the sequence's chunks."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        p_n, m_s = state_ptrs(h0, i_n, i_h, 0, i_v, H, K, V, BK, BV)
        S += tl.load(p_n, mask=m_s, other=0.0).to(tl.float32)
    dt = W.dtype.element_ty
    for c in range(tl.load(seq_chunks + i_n), tl.load(seq_chunks + i_n + 1)):
        bos, n = tl.load(chunk_bos + c), tl.load(chunk_len + c)
        p_c, m_s = state_ptrs(hs, c, i_h, 0, i_v, H, K, V, BK, BV)
        tl.store(p_c, S.to(hs.dtype.element_ty), mask=m_s)
        w = load_rows(W, bos, n, i_h, 0, H, K, BT, BK)
        v_new = load_rows(U, bos, n, i_h, i_v * BV, H, V, BT, BV) - tl.dot(w.to(dt), S.to(dt))
        store_rows(vnew, v_new, bos, n, i_h, i_v * BV, H, V, BT, BV)
        G_last = load_cumgate_row(G, bos + n - 1, i_h, 0, H, K, BK)
        k_end = load_qk(k, bos, n, i_h, H, K, BT, BK, L2NORM) * tl.exp(
            G_last[None, :] - load_cumgate(G, bos, n, i_h, H, K, BT, BK)
        )
        S = S * tl.exp(G_last)[:, None] + tl.dot(tl.trans(k_end.to(dt)), v_new.to(dt))
    if STORE_HT:
        p_t, m_s = state_ptrs(ht, i_n, i_h, 0, i_v, H, K, V, BK, BV)
        tl.store(p_t, S, mask=m_s)


@triton.autotune(configs=configs({"BV": (32, 64)}, {"BV": 32}), key=["H", "K", "V"])
@triton.jit
def output_kernel(
    q,
    G,
    P,
    hs,
    vnew,
    o,
    chunk_bos,
    chunk_len,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """o = (q e^G) S + P v' for one (value block, chunk, head)."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    dt = vnew.dtype.element_ty
    q_e = load_qk(q, bos, n, i_h, H, K, BT, BK, L2NORM) * scale * tl.exp(load_cumgate(G, bos, n, i_h, H, K, BT, BK))
    p_c, m_s = state_ptrs(hs, i_c, i_h, 0, i_v, H, K, V, BK, BV)
    S = tl.load(p_c, mask=m_s, other=0.0)
    out = tl.dot(q_e.to(dt), S.to(dt))
    out += tl.dot(
        load_block(P, bos, n, i_h, 0, H, BT, BT, BT).to(dt),
        load_rows(vnew, bos, n, i_h, i_v * BV, H, V, BT, BV).to(dt),
    )
    store_rows(o, out, bos, n, i_h, i_v * BV, H, V, BT, BV)
