"""Kimi Delta Attention by the token loop: the reference (one sequence at a time, ground truth for tests)
and the batched decode path.

Part of the flat, Hub-copyable model folder: torch only.
"""

from __future__ import annotations

import torch

from .kda_inputs import _compute_dtype, _prepare


def _token_loop(q, k, v, g, beta, state):
    """The step form, batched over sequences. q, k, g [N, T, H, K] (q scaled); v [N, T, H, V];
    beta [N, T, H]; state [N, H, K, V]. Returns o [N, T, H, V] and the final state."""
    decay = g.exp().unsqueeze(-1)
    outs = []
    for t in range(q.shape[1]):
        state = state * decay[:, t]
        k_t = k[:, t].unsqueeze(-2)  # [N, H, 1, K]
        pred = k_t @ state  # S^T k: [N, H, 1, V]
        delta = (v[:, t].unsqueeze(-2) - pred) * beta[:, t, :, None, None]
        state = state + k_t.transpose(-1, -2) @ delta
        outs.append(q[:, t].unsqueeze(-2) @ state)
    if not outs:  # an empty sequence of a packed batch
        return v.new_zeros(v.shape), state
    return torch.cat(outs, dim=-2).transpose(1, 2), state


def _initial(initial_state, N, H, K, V, q):
    dt = _compute_dtype(q)
    if initial_state is None:
        return q.new_zeros(N, H, K, V, dtype=dt)
    return initial_state.to(dt)


def naive_recurrent_kda(
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None, use_qk_l2norm=False
):
    """Reference: the token loop in fp32, one sequence at a time (no padding, no chunking)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, s, e) for s, e in zip(cu, cu[1:])]
    S0 = _initial(initial_state, len(spans), H, K, V, q)
    outs, finals = [], []
    for n, (b, s, e) in enumerate(spans):
        o, S = _token_loop(
            q[b : b + 1, s:e],
            k[b : b + 1, s:e],
            v[b : b + 1, s:e],
            g[b : b + 1, s:e],
            beta[b : b + 1, s:e],
            S0[n : n + 1],
        )
        outs.append(o)
        finals.append(S)
    o = torch.cat(outs, dim=0 if cu_seqlens is None else 1)
    return o, (torch.cat(finals) if output_final_state else None)


def _recurrent_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None, use_qk_l2norm=False):
    """Decode path: the token loop batched over all sequences (packed ones are padded at their end
    with no-op tokens: g = 0, k = 0, beta = 0 leave the state unchanged)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    if cu_seqlens is None:
        S0 = _initial(initial_state, B, H, K, V, q)
        o, S = _token_loop(q, k, v, g, beta, S0)
        return o, (S if output_final_state else None)
    cu = cu_seqlens.tolist()
    N, L = len(cu) - 1, max(e - s for s, e in zip(cu, cu[1:]))
    src = torch.cat([torch.arange(s, e) for s, e in zip(cu, cu[1:])]).to(q.device)
    dst = torch.cat([torch.arange(s - cu[n], e - cu[n]) + n * L for n, (s, e) in enumerate(zip(cu, cu[1:]))]).to(
        q.device
    )

    def pad(x):
        flat = x.new_zeros(N * L, *x.shape[2:]).index_copy(0, dst, x[0].index_select(0, src))
        return flat.view(N, L, *x.shape[2:])

    o, S = _token_loop(*(pad(x) for x in (q, k, v, g, beta)), _initial(initial_state, N, H, K, V, q))
    o = o.reshape(N * L, H, V).index_select(0, dst).unsqueeze(0)
    return o, (S if output_final_state else None)
