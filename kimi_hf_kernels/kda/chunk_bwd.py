"""Chunked KDA backward kernels. The forward's W, U, per-chunk states S and v' are recomputed
(`wy_kernel` without the inverse, then `state_kernel`) rather than stored; then, with S the state
entering a chunk and dS' the gradient of the state leaving it:

1. `state_bwd`: the only sequential stage, last chunk to first: store dS',
   dv' = P^T dO + K_end dS' (K_end = e^{G_last - G} k), dS = e^{G_last} dS' + (q e^G)^T dO - W^T dv'.
2. `local_bwd`: per chunk, the terms that involve S or dS': d(q e^G) = dO S^T, dW = -dv' S^T,
   dK_end = v' dS'^T, dP = dO v'^T, and the gradient of G_last.
3. `wy_bwd`: through W = X R_w, U = X R_u and X = (I + A)^-1: dR = X^T d[W|U],
   dA = -X^T (dW R_w^T + dU R_u^T) X^T (strictly lower part).
4. `intra_bwd`: through the anchored scores A, P (same sub-blocks and anchors as the forward), then
   sums all partial gradients, turns dG into dg by a reverse cumsum inside the chunk, and applies
   the backward of the fused scale / L2 norm / gate (either gate: `common.gate_bwd`) / beta sigmoid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    configs,
    gate_bwd,
    gate_scale,
    l2norm_bwd,
    load_beta,
    load_block,
    load_cumgate,
    load_cumgate_cols,
    load_cumgate_row,
    load_qk,
    load_rows,
    qk_row_scale,
    state_ptrs,
    store_block,
    store_rows,
)


@triton.autotune(configs=configs({"BV": (32, 64)}, {"BV": 32}), key=["H", "K", "V"])
@triton.jit
def state_bwd_kernel(
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
    chunk_bos,
    chunk_len,
    seq_chunks,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        p_n, m_s = state_ptrs(dht, i_n, i_h, 0, i_v, H, K, V, BK, BV)
        dS += tl.load(p_n, mask=m_s, other=0.0).to(tl.float32)
    dt = W.dtype.element_ty
    c0, c1 = tl.load(seq_chunks + i_n), tl.load(seq_chunks + i_n + 1)
    for cc in range(c0, c1):
        c = c1 - 1 - (cc - c0)
        bos, n = tl.load(chunk_bos + c), tl.load(chunk_len + c)
        p_c, m_s = state_ptrs(dhs, c, i_h, 0, i_v, H, K, V, BK, BV)
        tl.store(p_c, dS, mask=m_s)
        Gt = load_cumgate(G, bos, n, i_h, H, K, BT, BK)
        G_last = load_cumgate_row(G, bos + n - 1, i_h, 0, H, K, BK)
        k_end = load_qk(k, bos, n, i_h, H, K, BT, BK, L2NORM) * tl.exp(G_last[None, :] - Gt)
        d_o = load_rows(do, bos, n, i_h, i_v * BV, H, V, BT, BV)
        dv_new = tl.dot(tl.trans(load_block(P, bos, n, i_h, 0, H, BT, BT, BT).to(dt)), d_o.to(dt))
        dv_new += tl.dot(k_end.to(dt), dS.to(dt))
        store_rows(dvnew, dv_new, bos, n, i_h, i_v * BV, H, V, BT, BV)
        q_e = load_qk(q, bos, n, i_h, H, K, BT, BK, L2NORM) * scale * tl.exp(Gt)
        w = load_rows(W, bos, n, i_h, 0, H, K, BT, BK)
        dS = (
            dS * tl.exp(G_last)[:, None]
            + tl.dot(tl.trans(q_e.to(dt)), d_o.to(dt))
            - tl.dot(tl.trans(w.to(dt)), dv_new.to(dt))
        )
    if STORE_DH0:
        p_0, m_s = state_ptrs(dh0, i_n, i_h, 0, i_v, H, K, V, BK, BV)
        tl.store(p_0, dS, mask=m_s)


@triton.autotune(configs=configs({}), key=["H", "K", "V"])
@triton.jit
def local_bwd_kernel(
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
    chunk_bos,
    chunk_len,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BKB: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """One program per (chunk, head, block of BKB key channels); the first block also stores dP."""
    i_c, i_h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, n = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    k0 = i_k * BKB
    dt = vnew.dtype.element_ty
    d_qe = tl.zeros([BT, BKB], dtype=tl.float32)
    d_w = tl.zeros([BT, BKB], dtype=tl.float32)
    d_kend = tl.zeros([BT, BKB], dtype=tl.float32)
    d_last = tl.zeros([BKB], dtype=tl.float32)  # sum_v dS' * S, the e^{G_last} S term's gradient
    for i_v in range(tl.cdiv(V, BV)):
        p_c, m_s = state_ptrs(hs, i_c, i_h, k0, i_v, H, K, V, BKB, BV)
        S = tl.load(p_c, mask=m_s, other=0.0)
        p_d, _ = state_ptrs(dhs, i_c, i_h, k0, i_v, H, K, V, BKB, BV)
        dS = tl.load(p_d, mask=m_s, other=0.0)
        v_new = load_rows(vnew, bos, n, i_h, i_v * BV, H, V, BT, BV).to(dt)
        dv_new = load_rows(dvnew, bos, n, i_h, i_v * BV, H, V, BT, BV).to(dt)
        d_o = load_rows(do, bos, n, i_h, i_v * BV, H, V, BT, BV).to(dt)
        d_qe += tl.dot(d_o, tl.trans(S.to(dt)))
        d_w -= tl.dot(dv_new, tl.trans(S.to(dt)))
        d_kend += tl.dot(v_new, tl.trans(dS.to(dt)))
        d_last += tl.sum(dS.to(tl.float32) * S.to(tl.float32), 1)
    Gt = load_cumgate_cols(G, bos, n, i_h, k0, H, K, BT, BKB)
    G_last = load_cumgate_row(G, bos + n - 1, i_h, k0, H, K, BKB)
    e_G = tl.exp(Gt)
    e_end = tl.exp(G_last[None, :] - Gt)
    q_e = (
        load_rows(q, bos, n, i_h, k0, H, K, BT, BKB)
        * (qk_row_scale(q, bos, n, i_h, H, K, BT, BKB, L2NORM) * scale)[:, None]
        * e_G
    )
    k_end = (
        load_rows(k, bos, n, i_h, k0, H, K, BT, BKB)
        * qk_row_scale(k, bos, n, i_h, H, K, BT, BKB, L2NORM)[:, None]
        * e_end
    )
    d_G = d_qe * q_e - d_kend * k_end
    d_last = d_last * tl.exp(G_last) + tl.sum(d_kend * k_end, 0)
    r = tl.arange(0, BT)
    d_G += tl.where(r[:, None] == n - 1, d_last[None, :], 0.0)  # G_last is G at the chunk's last row
    store_rows(dq1, d_qe * e_G, bos, n, i_h, k0, H, K, BT, BKB)
    store_rows(dk1, d_kend * e_end, bos, n, i_h, k0, H, K, BT, BKB)
    store_rows(dG1, d_G, bos, n, i_h, k0, H, K, BT, BKB)
    store_rows(dW, d_w, bos, n, i_h, k0, H, K, BT, BKB)
    if i_k == 0:
        d_p = tl.zeros([BT, BT], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            d_o = load_rows(do, bos, n, i_h, i_v * BV, H, V, BT, BV).to(dt)
            d_p += tl.dot(d_o, tl.trans(load_rows(vnew, bos, n, i_h, i_v * BV, H, V, BT, BV).to(dt)))
        store_block(dP, tl.where(r[:, None] >= r[None, :], d_p, 0.0), bos, n, i_h, 0, H, BT, BT, BT)


@triton.autotune(configs=configs({}), key=["H", "K", "V"])
@triton.jit
def wy_bwd_kernel(
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
    chunk_bos,
    chunk_len,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BKB: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
):
    """One program per (chunk, head), walking K and V in column blocks."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    x = load_block(X, bos, n, i_h, 0, H, BT, BT, BT)
    b = load_beta(beta, bos, n, i_h, H, BT, BETA_SIGMOID)
    k_scale = qk_row_scale(k, bos, n, i_h, H, K, BT, BKB, L2NORM)[:, None]
    d_x = tl.zeros([BT, BT], dtype=tl.float32)
    d_b = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BKB):
        e_G = tl.exp(load_cumgate_cols(G, bos, n, i_h, k0, H, K, BT, BKB))
        k_e = load_rows(k, bos, n, i_h, k0, H, K, BT, BKB) * k_scale * e_G
        d_w = load_rows(dW, bos, n, i_h, k0, H, K, BT, BKB)
        d_rw = tl.dot(tl.trans(x), d_w)
        d_x += tl.dot(d_w, tl.trans(k_e * b[:, None]))
        d_b += tl.sum(d_rw * k_e, 1)
        store_rows(dk2, d_rw * b[:, None] * e_G, bos, n, i_h, k0, H, K, BT, BKB)
        store_rows(dG2, d_rw * b[:, None] * k_e, bos, n, i_h, k0, H, K, BT, BKB)
    for i_v in range(tl.cdiv(V, BV)):
        v_ = load_rows(v, bos, n, i_h, i_v * BV, H, V, BT, BV)
        d_u = load_rows(dvnew, bos, n, i_h, i_v * BV, H, V, BT, BV)
        d_ru = tl.dot(tl.trans(x), d_u)
        d_x += tl.dot(d_u, tl.trans(v_ * b[:, None]))
        d_b += tl.sum(d_ru * v_, 1)
        store_rows(dv, d_ru * b[:, None], bos, n, i_h, i_v * BV, H, V, BT, BV)
    r = tl.arange(0, BT)
    d_a = -tl.dot(tl.dot(tl.trans(x), d_x, input_precision="tf32x3"), tl.trans(x), input_precision="tf32x3")
    store_block(dA, tl.where(r[:, None] > r[None, :], d_a, 0.0), bos, n, i_h, 0, H, BT, BT, BT)
    tl.store(dbeta2 + (bos + r).to(tl.int64) * H + i_h, d_b, mask=r < n)


@triton.jit
def _diag_scores_bwd(q_i, k_i, G_i, b_i, d_a, d_p, dq, dk, dG, db, BC: tl.constexpr):
    """Backward of `_diag_scores` (a already scaled by beta): column by column, the same exponents."""
    r = tl.arange(0, BC)
    for c in range(BC):
        at_c = r[:, None] == c
        k_c = tl.sum(tl.where(at_c, k_i, 0.0), 0)
        G_c = tl.sum(tl.where(at_c, G_i, 0.0), 0)
        e = tl.exp(tl.where(r[:, None] >= c, G_i - G_c[None, :], float("-inf")))
        da_c = tl.sum(tl.where(r[None, :] == c, d_a, 0.0), 1)  # column c (zero for rows <= c)
        dp_c = tl.sum(tl.where(r[None, :] == c, d_p, 0.0), 1)  # zero for rows < c
        e_k = e * k_c[None, :]
        db += da_c * tl.sum(k_i * e_k, 1)
        z_k = (da_c * b_i)[:, None] * e_k
        z_q = dp_c[:, None] * e_k
        dk += z_k
        dq += z_q
        y = z_k * k_i + z_q * q_i
        dG += y
        col_dk = tl.sum(((da_c * b_i)[:, None] * k_i + dp_c[:, None] * q_i) * e, 0)
        dk += tl.where(at_c, col_dk[None, :], 0.0)
        dG -= tl.where(at_c, tl.sum(y, 0)[None, :], 0.0)
    return dq, dk, dG, db


@triton.autotune(configs=configs({}), key=["H", "K", "L2NORM", "GATE", "SAFE_GATE"])
@triton.jit
def intra_bwd_kernel(
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
    chunk_bos,
    chunk_len,
    scale,
    lower_bound,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr,
    GATE: tl.constexpr,
    SAFE_GATE: tl.constexpr,
    HAS_A: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, n = tl.load(chunk_bos + i_c), tl.load(chunk_len + i_c)
    NS: tl.constexpr = BT // BC
    r = tl.arange(0, BC)
    later = tl.zeros([BK], dtype=tl.float32)  # sum of dG over the sub-chunks after this one
    d_alog = tl.zeros([BK], dtype=tl.float32)
    if GATE:
        a = gate_scale(A_log, i_h, HAS_A)
    for tt in range(NS):  # last sub-chunk first: `later` carries the reverse cumsum across them
        t = NS - 1 - tt
        t_t, n_t = bos + t * BC, n - t * BC
        q_t = load_qk(q, t_t, n_t, i_h, H, K, BC, BK, L2NORM) * scale
        k_t = load_qk(k, t_t, n_t, i_h, H, K, BC, BK, L2NORM)
        G_t = load_cumgate(G, t_t, n_t, i_h, H, K, BC, BK)
        b_t = load_beta(beta, t_t, n_t, i_h, H, BC, BETA_SIGMOID)
        G_n = load_cumgate_row(G, bos + tl.minimum(t * BC, n - 1), i_h, 0, H, K, BK)
        E_t = tl.exp(G_t - G_n[None, :])
        d_q = load_rows(dq1, t_t, n_t, i_h, 0, H, K, BC, BK)
        d_k = load_rows(dk1, t_t, n_t, i_h, 0, H, K, BC, BK) + load_rows(dk2, t_t, n_t, i_h, 0, H, K, BC, BK)
        d_G = load_rows(dG1, t_t, n_t, i_h, 0, H, K, BC, BK) + load_rows(dG2, t_t, n_t, i_h, 0, H, K, BC, BK)
        d_b = tl.load(dbeta2 + (t_t + r).to(tl.int64) * H + i_h, mask=r < n_t, other=0.0)
        for j in range(t):  # block (t, j): sub-chunk t on the row side, anchored at its first row
            k_j = load_qk(k, bos + j * BC, n - j * BC, i_h, H, K, BC, BK, L2NORM)
            c_j = k_j * tl.exp(G_n[None, :] - load_cumgate(G, bos + j * BC, n - j * BC, i_h, H, K, BC, BK))
            d_a = load_block(dA, t_t, n_t, i_h, j * BC, H, BT, BC, BC)
            d_p = load_block(dP, t_t, n_t, i_h, j * BC, H, BT, BC, BC)
            r_k = k_t * E_t
            r_q = q_t * E_t
            d_b += tl.sum(d_a * tl.dot(r_k, tl.trans(c_j)), 1)
            d_rk = tl.dot(d_a * b_t[:, None], c_j)
            d_rq = tl.dot(d_p, c_j)
            d_k += d_rk * E_t
            d_q += d_rq * E_t
            d_G += d_rk * r_k + d_rq * r_q
        for j in range(t + 1, NS):  # block (j, t): sub-chunk t on the column side, anchored at sub-chunk j's first row
            t_j, n_j = bos + j * BC, n - j * BC
            G_m = load_cumgate_row(G, bos + tl.minimum(j * BC, n - 1), i_h, 0, H, K, BK)
            E_j = tl.exp(load_cumgate(G, t_j, n_j, i_h, H, K, BC, BK) - G_m[None, :])
            b_j = load_beta(beta, t_j, n_j, i_h, H, BC, BETA_SIGMOID)
            r_k = load_qk(k, t_j, n_j, i_h, H, K, BC, BK, L2NORM) * E_j
            r_q = load_qk(q, t_j, n_j, i_h, H, K, BC, BK, L2NORM) * scale * E_j
            d_a = load_block(dA, t_j, n_j, i_h, t * BC, H, BT, BC, BC) * b_j[:, None]
            d_p = load_block(dP, t_j, n_j, i_h, t * BC, H, BT, BC, BC)
            F_t = tl.exp(G_m[None, :] - G_t)
            d_c = tl.dot(tl.trans(d_a), r_k) + tl.dot(tl.trans(d_p), r_q)
            d_k += d_c * F_t
            d_G -= d_c * F_t * k_t
        d_q, d_k, d_G, d_b = _diag_scores_bwd(
            q_t,
            k_t,
            G_t,
            b_t,
            load_block(dA, t_t, n_t, i_h, t * BC, H, BT, BC, BC),
            load_block(dP, t_t, n_t, i_h, t * BC, H, BT, BC, BC),
            d_q,
            d_k,
            d_G,
            d_b,
            BC,
        )
        # G is the cumsum of g inside the chunk: dg = reverse cumsum of dG over the chunk's rows
        d_g = tl.cumsum(d_G, 0, reverse=True) + later[None, :]
        later += tl.sum(d_G, 0)
        d_q = l2norm_bwd(load_rows(q, t_t, n_t, i_h, 0, H, K, BC, BK), d_q * scale, L2NORM)
        d_k = l2norm_bwd(load_rows(k, t_t, n_t, i_h, 0, H, K, BC, BK), d_k, L2NORM)
        store_rows(dq, d_q, t_t, n_t, i_h, 0, H, K, BC, BK)
        store_rows(dk, d_k, t_t, n_t, i_h, 0, H, K, BC, BK)
        if GATE:  # g = gate(f + dt_bias): df = dg * gate'(f + dt_bias); dA_log summed over the chunk
            f = load_rows(g, t_t, n_t, i_h, 0, H, K, BC, BK)
            if HAS_BIAS:
                f += tl.load(dt_bias + i_h * K + tl.arange(0, BK), mask=tl.arange(0, BK) < K, other=0.0).to(
                    tl.float32
                )[None, :]
            d_g, d_l = gate_bwd(f, d_g, a, lower_bound, SAFE_GATE)
            if HAS_A:
                d_alog += tl.sum(tl.where((r < n_t)[:, None], d_l, 0.0), 0)
        store_rows(dg, d_g, t_t, n_t, i_h, 0, H, K, BC, BK)
        if BETA_SIGMOID:
            d_b = d_b * b_t * (1.0 - b_t)
        tl.store(dbeta + (t_t + r).to(tl.int64) * H + i_h, d_b, mask=r < n_t)
    if GATE and HAS_A:
        tl.store(dA_log + i_c.to(tl.int64) * H + i_h, tl.sum(d_alog, 0))
