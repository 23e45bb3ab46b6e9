"""Kimi Delta Attention with the sequence split over context-parallel ranks (each rank holds consecutive tokens).

Why the ranks can run at once: over a segment of tokens the KDA state update is affine in the incoming state,

    S_end = A S_in + b,        A = prod_t (I - beta_t k_t k_t^T) Diag(exp(g_t))  [K, K],  b: the zero-start state,

and so is every output, o_t = o_t(0) + S_in^T P_t^T q_t (P_t the partial product up to t). One chunked pass per rank
computes all of it: the values widened by K zero columns, v' = [v, 0], and the incoming state [0, I] give the state
[b, A] and the outputs [o_t(0), P_t^T q_t] (the identity columns carry P_t through the same recurrence). The ranks
then exchange their (A, b) (an all-gather of [B, H, K, V + K] fp32 values a layer: independent of T), fold the
earlier ranks' maps into their S_in and add the correction S_in^T (P_t^T q_t). Cost: one pass at width V + K instead
of V on ranks > 0 (Kimi's K = V = 128: 256, within the Triton kernels' head-dim limit); no rank waits for another's
scan (passing the final states along the ranks instead would run them one after another). The gradients flow back
through the same all-gather. With bf16 inputs the pass returns o_t(0) and P_t^T q_t in bf16 (as chunk_kda returns its
outputs): the correction adds one bf16 rounding that one process does not have.

Packed documents (cu_seqlens) may cross a rank boundary: only a row's first local document can continue the
previous rank's last one (`continues`), so only it gets the identity columns; a later document starts from zero and
makes A zero.

Part of the flat, Hub-copyable model folder: torch and torch.distributed only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .kda import chunk_kda


__all__ = ["all_gather_sequence", "chunk_kda_context_parallel", "fold_incoming_states"]


class _AllGather(torch.autograd.Function):
    """Stacks every rank's x into [size, *x.shape]; the gradient of a rank's x is the sum over the ranks of their
    gradients for its slot (an all-reduce), since every rank reads every slot."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[*shape] on each rank -> [size, *shape] (rank order), differentiable."""
    return _AllGather.apply(x, group)


def fold_incoming_states(A: torch.Tensor, b: torch.Tensor, rank: int) -> torch.Tensor | None:
    """The state entering rank `rank`: S = 0, then S = A_j S + b_j for j = 0 .. rank - 1.
    A [size, B, H, K, K], b [size, B, H, K, V] -> [B, H, K, V] (None on rank 0)."""
    S = None
    for j in range(rank):
        S = b[j] if S is None else A[j] @ S + b[j]
    return S


def chunk_kda_context_parallel(
    q,
    k,
    v,
    g,
    beta,
    *,
    group,
    continues: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    first_seq: torch.Tensor | None = None,
    last_seq: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """`chunk_kda` over this rank's tokens of sequences split over the ranks of `group` (in rank order).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta [B, T, H] (this rank's T tokens; `chunk_kda`'s other keyword
    arguments, gate fusion included, pass through). continues: [R] bool, whether row r's first sequence continues
    the previous rank's (rank 0: all False). Packed: B = 1 here is the R rows flattened, cu_seqlens [N + 1] over
    them, first_seq / last_seq [R] the index of each row's first / last sequence; unpacked: R = B, one sequence a
    row. Returns o [B, T, H, V] in q's dtype: equal to chunk_kda over the whole sequences (no initial state).
    """
    if "initial_state" in kwargs or "output_final_state" in kwargs:
        raise ValueError("chunk_kda_context_parallel: no initial_state / output_final_state (the ranks pass states)")
    B, T, H, K = q.shape
    V = v.shape[-1]
    rows = continues.shape[0]
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32  # the states' dtype (fp64: exact checks)
    if cu_seqlens is None:
        N, first_seq, last_seq = B, torch.arange(B, device=q.device), torch.arange(B, device=q.device)
    else:
        N = cu_seqlens.numel() - 1
    rank = dist.get_rank(group)
    if rank == 0:  # nothing enters rank 0: the plain pass (its A is never read)
        o, b = chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens, **kwargs)
        b, A, Pq = b[last_seq], b.new_zeros(rows, H, K, K), None
    else:
        # one pass with the values widened by K zeros and the incoming state [0 | I] on each continuing row's first
        # sequence: the state ends as [b | A], the outputs are [o_t(0) | P_t^T q_t]. One pass of width V + K keeps
        # the chunk factors that do not depend on V (the [C, C] ones, the decays) once: two passes would hold them twice.
        S_in = torch.zeros(N, H, K, V + K, dtype=sdt, device=q.device)
        S_in[first_seq, ..., V:] = torch.eye(K, dtype=sdt, device=q.device) * continues.view(rows, 1, 1, 1).to(sdt)
        wide = torch.cat([v, v.new_zeros(B, T, H, K)], -1)
        out, final = chunk_kda(
            q, k, wide, g, beta, initial_state=S_in, output_final_state=True, cu_seqlens=cu_seqlens, **kwargs
        )
        o, Pq = out[..., :V], out[..., V:]
        final = final[last_seq]  # [R, H, K, V + K]
        b, A = final[..., :V], final[..., V:]
    maps = all_gather_sequence(torch.cat([b, A], -1), group)  # [size, R, H, K, V + K]: one collective
    S0 = fold_incoming_states(maps[..., V:], maps[..., :V], rank)
    if S0 is None:  # rank 0: nothing enters it. Its output still reads the gathered maps (times zero) so that every
        # rank runs the all-gather's backward, an all-reduce: the ranks' collectives must match one to one
        return o + 0.0 * maps.sum().to(o.dtype)
    # o_t += S_in^T (P_t^T q_t) per row: tokens outside a row's first sequence have Pq = 0
    Pq = Pq.reshape(rows, -1, H, K).to(sdt)
    fix = torch.einsum("rthk,rhkv->rthv", Pq, S0).reshape(o.shape)
    return (o.to(sdt) + fix).to(o.dtype)
