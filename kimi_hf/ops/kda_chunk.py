"""Kimi Delta Attention, chunked in PyTorch: an exact algorithm from batched matmuls with a hand-written
backward (the CPU path). Every pair of tokens in a chunk is scored at the binary level that separates them,
both factors bounded by 1, so any gate strength stays finite; the only sequential work is one [K, K] x [K, V]
matmul per chunk.

Part of the flat, Hub-copyable model folder: torch only.
"""

import functools

import torch
import torch.nn.functional as F

from .kda_inputs import _prepare
from .kda_recurrent import _initial


CHUNK_SIZE = 64


_LOG2E = 1.4426950408889634  # the chunk path keeps G * log2(e): exp2 is ~2x cheaper than exp on CPU


class _ChunkLayout:
    """Maps tokens [B, T, H, D] to chunks [Nch, H, C, D] and back, and runs the scan over chunks.

    Every sequence starts a new chunk; its last chunk is padded with no-op tokens (zeros: g = 0,
    k = 0, beta = 0 leave the state unchanged). Equal-length batches are stored chunk-major (chunk j
    of every sequence side by side), so that each scan step is one batched matmul over a view.
    """

    def __init__(self, B: int, T: int, C: int, cu_seqlens, device):
        self.B, self.T, self.C = B, T, C
        self.varlen = cu_seqlens is not None
        if not self.varlen:
            self.NC = -(-T // C)
            self.N, self.num_chunks = B, B * self.NC
            return
        cu = cu_seqlens.tolist()
        lens = [e - s for s, e in zip(cu, cu[1:])]
        self.N = len(lens)
        self.nch = [-(-n // C) for n in lens]
        self.first = [sum(self.nch[:n]) for n in range(self.N)]  # first chunk of each sequence
        self.num_chunks = sum(self.nch)
        # token t of sequence n goes to slot first[n] * C + (t - cu[n]) of the padded buffer
        self.dst = torch.cat([torch.arange(lens[n]) + self.first[n] * C for n in range(self.N)]).to(device)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] -> [Nch, H, C, D]."""
        C, H, D = self.C, x.shape[2], x.shape[3]
        if self.varlen:
            buf = x.new_zeros(self.num_chunks * C, H, D).index_copy(0, self.dst, x[0])
            return buf.view(self.num_chunks, C, H, D).transpose(1, 2).contiguous()
        x = F.pad(x, (0, 0, 0, 0, 0, self.NC * C - self.T))
        return x.view(self.B, self.NC, C, H, D).permute(1, 0, 3, 2, 4).reshape(self.num_chunks, H, C, D)

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """[Nch, H, C, D] -> [B, T, H, D]."""
        Nch, H, C, D = y.shape
        if self.varlen:
            return y.transpose(1, 2).reshape(Nch * C, H, D).index_select(0, self.dst).unsqueeze(0)
        y = y.view(self.NC, self.B, H, C, D).permute(1, 0, 3, 2, 4).reshape(self.B, self.NC * C, H, D)
        return y[:, : self.T]

    def scan(self, M: torch.Tensor, U: torch.Tensor, S0: torch.Tensor, reverse: bool = False):
        """Runs S <- M_c S + U_c over each sequence's chunks, first to last (last to first if reverse).

        M [Nch, H, K, K], U [Nch, H, K, V], S0 [N, H, K, V]. Returns the S entering every chunk's
        step [Nch, H, K, V] and the last S of every sequence [N, H, K, V].
        """
        H, K, V = U.shape[1:]
        if not self.varlen:
            B, NC = self.B, self.NC
            Ms = M.reshape(NC, B * H, K, K).unbind(0)
            Us = U.reshape(NC, B * H, K, V).unbind(0)
            S, ins = S0.reshape(B * H, K, V), [None] * NC
            for j in reversed(range(NC)) if reverse else range(NC):
                ins[j] = S
                S = torch.baddbmm(Us[j], Ms[j], S)
            return torch.stack(ins).view(self.num_chunks, H, K, V), S.view(B, H, K, V)
        # Sequences sorted by chunk count, longest first: those still running at step j are a
        # prefix, so they all advance in one batched matmul.
        Ms, Us = M.unbind(0), U.unbind(0)
        order = sorted(range(self.N), key=lambda n: -self.nch[n])
        S, ins = S0[order], [None] * self.num_chunks
        for j in range(max(self.nch, default=0)):
            ids = [self.first[n] + (self.nch[n] - 1 - j if reverse else j) for n in order if self.nch[n] > j]
            active = S[: len(ids)]
            for c, s in zip(ids, active.unbind(0)):
                ins[c] = s
            step = torch.baddbmm(
                torch.stack([Us[c] for c in ids]).flatten(0, 1),
                torch.stack([Ms[c] for c in ids]).flatten(0, 1),
                active.flatten(0, 1),
            ).view_as(active)
            S = step if len(ids) == self.N else torch.cat([step, S[len(ids) :]])
        final = S[sorted(range(self.N), key=order.__getitem__)]
        return torch.stack(ins), final


@functools.lru_cache(maxsize=None)
def _halves(C: int) -> tuple[int, ...]:
    """Half sizes of the binary levels of a chunk, coarse to fine: C/2, C/4, ..., 1."""
    return tuple(C >> (l + 1) for l in range(C.bit_length() - 1))


def _halves_of(x: torch.Tensor, h: int):
    """[N, H, C, D] -> views (first, second) [N, H, C/2h, h, D] of the two halves of every 2h-block."""
    N, H, C, D = x.shape
    v = x.view(N, H, C // (2 * h), 2, h, D)
    return v[:, :, :, 0], v[:, :, :, 1]


def _level(G2: torch.Tensor, k: torch.Tensor, q: torch.Tensor, h: int):
    """Operands of the exact decayed scores at one binary level (half size h).

    G2 [N, H, C, K] is the chunk-local cumsum of g times log2(e). In every 2h-block, token i carries
    a factor relative to the block's anchor m (its first second-half token): second-half rows get
    exp(G_i - G_m) <= 1 and first-half columns exp(G_m - G_j) <= 1 (G is non-increasing). Their
    product is exp(G_i - G_j) exactly, and no factor can overflow whatever the gates.
    Returns E [N, H, C, K] (the factors), rows [N, H, C/2h, 2h, K] = [k E; q E] of the second
    halves and cols [N, H, C/2h, h, K] = k E of the first halves.
    """
    N, H, C, K = G2.shape
    G_first, G_second = _halves_of(G2, h)
    G_m = G_second[:, :, :, :1]
    E = torch.empty_like(G2)
    E_first, E_second = _halves_of(E, h)
    torch.sub(G_second, G_m, out=E_second)
    torch.sub(G_m, G_first, out=E_first)
    E.exp2_()
    (k_first, k_second), (_, q_second) = _halves_of(k, h), _halves_of(q, h)
    rows = torch.empty(N, H, C // (2 * h), 2 * h, K, dtype=k.dtype, device=k.device)
    torch.mul(k_second, E_second, out=rows[..., :h, :])
    torch.mul(q_second, E_second, out=rows[..., h:, :])
    return E, rows, k_first * E_first


def _diag_blocks(D: torch.Tensor, h: int) -> torch.Tensor:
    """View [N, H, C/h, h, h] of the diagonal h x h blocks of [N, H, C, C] matrices."""
    N, H, C, _ = D.shape
    n = C // h
    return D.view(N, H, n, h, n, h).diagonal(dim1=2, dim2=4).permute(0, 1, 4, 2, 3)


def _quadrants(D: torch.Tensor, h: int) -> torch.Tensor:
    """View [N, H, C/2h, h, h] of the level-h quadrants of [N, H, C, C] matrices: rows [m, m+h) x
    columns [m-h, m) of every 2h-block (m = 2h b + h)."""
    return _diag_blocks(D, 2 * h)[..., h:, :h]


def _unit_lower_inverse(quads: dict, shape, like: torch.Tensor) -> torch.Tensor:
    """Inverse of the unit lower-triangular matrices whose level-h quadrants are quads[h]
    ([N, H, C/2h, h, h]), by block forward substitution, finest level first:
    inv([[L1, 0], [Q, L2]]) = [[X1, 0], [-X2 Q X1, X2]]."""
    N, H, C = shape
    X = torch.zeros(N, H, C, C, dtype=like.dtype, device=like.device)
    X.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    for h in reversed(_halves(C)):
        if h == 1:
            torch.neg(quads[h], out=_quadrants(X, 1))
            continue
        blocks = _diag_blocks(X, h)
        _quadrants(X, h).copy_(-(blocks[:, :, 1::2] @ quads[h] @ blocks[:, :, 0::2]))
    return X


# Chunks are processed in tiles of about this many bytes per [tile, H, C, K + V] tensor: the local
# work is elementwise-heavy, and tensors that stay in cache (and skip fresh page faults) run
# several times faster than whole-sequence ones.
_TILE_BYTES = 1 << 21


def _tiles(n: int, bytes_per_item: int):
    step = max(1, _TILE_BYTES // max(1, bytes_per_item))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _local_forward(q, k, v, G2, beta):
    """Everything about a tile of chunks that does not depend on the state entering them.

    q, k, G2 [n, H, C, K] (q scaled; G2 = chunk-local cumsum of g times log2 e); v [n, H, C, V];
    beta [n, H, C, 1]. Returns X [n, H, C, C] = (I + Diag(beta) A_kk)^-1, P [n, H, C, C] = A_qk,
    WU = X [beta e^G k | beta v], M [n, H, K, K], N [n, H, K, V] (S' = M S + N), Qt [n, H, C, K]
    and Ut [n, H, C, V] (o = Qt S + Ut).
    """
    n, H, C, K = q.shape
    # [K_end^T; A_qk] share one buffer so that both multiply [W | U] in a single matmul
    KP = torch.empty(n, H, K + C, C, dtype=q.dtype, device=q.device)
    P = KP[..., K:, :].zero_()
    torch.sum(q * k, -1, out=P.diagonal(dim1=-2, dim2=-1))
    L = {}  # half size -> quadrant of Diag(beta) A_kk
    for h in _halves(C):
        _, rows, cols = _level(G2, k, q, h)
        s = rows @ cols.transpose(-1, -2)
        L[h] = s[..., :h, :].mul_(_halves_of(beta, h)[1])
        _quadrants(P, h).copy_(s[..., h:, :])
    X = _unit_lower_inverse(L, (n, H, C), q)
    eG, G2_last = G2.exp2(), G2[:, :, -1:]
    R = torch.empty(n, H, C, K + v.shape[-1], dtype=q.dtype, device=q.device)
    torch.mul(k, eG, out=R[..., :K]).mul_(beta)
    torch.mul(v, beta, out=R[..., K:])
    WU = X @ R
    KP[..., :K, :] = torch.exp2(G2_last - G2).mul_(k).transpose(-1, -2)
    KPWU = KP @ WU  # [K_end^T W, K_end^T U; A_qk W, A_qk U]
    M = KPWU[..., :K, :K].neg()
    M.diagonal(dim1=-2, dim2=-1).add_(G2_last.squeeze(2).exp2())
    Qt = (q * eG).sub_(KPWU[..., K:, :K])
    return X, P, WU, M, KPWU[..., :K, K:], Qt, KPWU[..., K:, K:]


def _local_backward(q, k, v, G2, beta, X, P, WU, S_in, dO, dS_next):
    """Gradients of a tile of chunks given dO [n, H, C, V] and dS_next [n, H, K, V], the gradient of
    the state leaving each chunk. Returns dq, dk, dv, dg (w.r.t. the raw g), dbeta."""
    n, H, C, K = q.shape
    dQt = dO @ S_in.transpose(-1, -2)
    dKWU = torch.cat([-(dS_next @ S_in.transpose(-1, -2)), dS_next], dim=-1)  # d[-M | N]
    dPWU = torch.cat([-dQt, dO], dim=-1)
    eG, G2_last = G2.exp2(), G2[:, :, -1:]
    d_end = torch.exp2(G2_last - G2)
    k_end = k * d_end
    dWU = P.transpose(-1, -2) @ dPWU + k_end @ dKWU
    dP = dPWU @ WU.transpose(-1, -2)
    dk_end = WU @ dKWU.transpose(-1, -2)
    dR = X.transpose(-1, -2) @ dWU
    dL = dR @ WU.transpose(-1, -2)  # minus the gradient of the unit lower-triangular matrix

    dP_diag = dP.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    dq = (dQt * eG).addcmul_(dP_diag, k)
    dk = (dk_end * d_end).addcmul_(dP_diag, q)
    dG = (dQt * q).mul_(eG).sub_(dk_end * k_end)
    dR_w = dR[..., :K] * eG
    dk.addcmul_(dR_w, beta)
    dG.addcmul_(dR_w * k, beta)
    dbeta = (dR_w * k).sum(-1, keepdim=True).add_((dR[..., K:] * v).sum(-1, keepdim=True))
    dv = dR[..., K:] * beta
    G_last_grad = (dk_end * k_end).sum(-2) - dKWU[..., :K].diagonal(dim1=-2, dim2=-1) * G2_last.squeeze(2).exp2()

    # decayed scores, level by level: recompute the factors, route dA_kk and dA_qk through them
    for h in _halves(C):
        E, rows, cols = _level(G2, k, q, h)
        dL_q = _quadrants(dL, h)
        A = rows[..., :h, :] @ cols.transpose(-1, -2)
        _halves_of(dbeta, h)[1].sub_((dL_q * A).sum(-1, keepdim=True))
        dS = torch.cat([dL_q * -_halves_of(beta, h)[1], _quadrants(dP, h)], dim=-2)  # d[A_kk; A_qk]
        d_rows, d_cols = dS @ cols, dS.transpose(-1, -2) @ rows
        E_first, E_second = _halves_of(E, h)
        (k_first, k_second), (_, q_second) = _halves_of(k, h), _halves_of(q, h)
        (dk_first, dk_second), (_, dq_second) = _halves_of(dk, h), _halves_of(dq, h)
        dG_first, dG_second = _halves_of(dG, h)
        # d exp(G_i - G_j) / dG = +1 on the row side, -1 on the column side: the anchor cancels
        Z = d_rows[..., :h, :].mul_(E_second)
        dk_second.add_(Z)
        dG_second.addcmul_(Z, k_second)
        Z = d_rows[..., h:, :].mul_(E_second)
        dq_second.add_(Z)
        dG_second.addcmul_(Z, q_second)
        Z = d_cols.mul_(E_first)
        dk_first.add_(Z)
        dG_first.addcmul_(Z, k_first, value=-1.0)
    dG[:, :, -1] += G_last_grad
    return dq, dk, dv, dG.flip(2).cumsum(2).flip(2), dbeta


def _chunk_forward(q, k, v, g, beta, S0, layout: _ChunkLayout, need_grad: bool):
    """Exact chunked KDA, forward.

    Per chunk of C tokens, with G the chunk-local cumsum of g (every exponent used is <= 0):
        A_kk, A_qk: decayed k.k (j < i) and q.k (j <= i) scores, built level by level (see
                    `_level`), never as a [C, C, K] tensor;
        X = (I + Diag(beta) A_kk)^-1 by block forward substitution on the same levels;
        [W | U] = X [beta e^G k | beta v];   K_end = e^{G_C - G} k;
        M = Diag(e^{G_C}) - K_end^T W,  N = K_end^T U          (the chunk's state transition)
        o = (q e^G - A_qk W) S + A_qk U,  S' = M S + N           (S: the state entering the chunk)
    so the only sequential work is one [K, K] x [K, V] matmul per chunk, forward and backward.
    The backward recomputes the level factors instead of storing them (log2(C) times k's size).

    q, k, g [Nch, H, C, K] (q scaled); v [Nch, H, C, V]; beta [Nch, H, C, 1]; S0 [N, H, K, V]. Returns o
    [Nch, H, C, V], the final states [N, H, K, V] and what the backward needs (G2, X, P, WU, M, Qt, S_in; empty
    tensors unless need_grad).
    """
    Nch, H, C, K = q.shape
    V = v.shape[-1]
    G2 = g.cumsum(2).mul_(_LOG2E)
    new = functools.partial(torch.empty, dtype=q.dtype, device=q.device)
    M, Nst, Qt, Ut = new(Nch, H, K, K), new(Nch, H, K, V), new(Nch, H, C, K), new(Nch, H, C, V)
    # X, P and [W | U] are kept for the backward only
    X, P, WU = (new(Nch, H, C, C), new(Nch, H, C, C), new(Nch, H, C, K + V)) if need_grad else (None,) * 3
    for sl in _tiles(Nch, H * C * (K + V) * q.element_size()):
        for dst, src in zip((X, P, WU, M, Nst, Qt, Ut), _local_forward(q[sl], k[sl], v[sl], G2[sl], beta[sl])):
            if dst is not None:
                dst[sl] = src
    S_in, S_final = layout.scan(M, Nst, S0)
    o = torch.baddbmm(Ut.flatten(0, 1), Qt.flatten(0, 1), S_in.flatten(0, 1)).view_as(Ut)
    if not need_grad:
        G2, X, P, WU, M, Qt, S_in = (new(0) for _ in range(7))
    return o, S_final, G2, X, P, WU, M, Qt, S_in


def _chunk_backward(q, k, v, G2, beta, X, P, WU, M, Qt, S_in, dO, dS_final, layout: _ChunkLayout):
    """Gradients of `_chunk_forward` w.r.t. q, k, v, g, beta and S0 (dS_final: None for zeros)."""
    Nch, H, C, K = q.shape
    dO = dO.contiguous()
    if dS_final is None:
        dS_final = q.new_zeros(layout.N, *S_in.shape[1:])
    # state gradients, last chunk to first: dS_c = M_c^T dS_{c+1} + Qt_c^T dO_c
    dS_next, dS0 = layout.scan(M.transpose(-1, -2), Qt.transpose(-1, -2) @ dO, dS_final, reverse=True)
    grads = [torch.empty_like(x) for x in (q, k, v, G2, beta)]
    for sl in _tiles(Nch, H * C * (K + v.shape[-1]) * q.element_size()):
        saved = (x[sl] for x in (q, k, v, G2, beta, X, P, WU, S_in, dO, dS_next))
        for dst, src in zip(grads, _local_backward(*saved)):
            dst[sl] = src
    return (*grads, dS0)


# torch.compile sees the chunked algorithm as two opaque operators (its in-place work into views and the
# Python scan over chunks do not trace), with shapes declared below and a registered backward. The names are
# shared by every copy of this file in a process (the package and Hub remote-code copies): the first wins.
_OP_NAMESPACE = "kimi_hf"


def _define_ops():
    lib = getattr(torch.ops, _OP_NAMESPACE)
    if hasattr(lib, "chunk_kda_forward"):
        return lib.chunk_kda_forward, lib.chunk_kda_backward

    @torch.library.custom_op(f"{_OP_NAMESPACE}::chunk_kda_forward", mutates_args=())
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        S0: torch.Tensor,
        B: int,
        T: int,
        cu_seqlens: torch.Tensor | None,
        need_grad: bool,
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
    ]:
        layout = _ChunkLayout(B, T, q.shape[2], cu_seqlens, q.device)
        return _chunk_forward(q, k, v, g, beta, S0, layout, need_grad)

    @forward.register_fake
    def _(q, k, v, g, beta, S0, B, T, cu_seqlens, need_grad):
        Nch, H, C, K = q.shape
        V = v.shape[-1]
        if not need_grad:
            return (v.new_empty(Nch, H, C, V), S0.new_empty(S0.shape), *(q.new_empty(0) for _ in range(7)))
        return (
            v.new_empty(Nch, H, C, V),
            S0.new_empty(S0.shape),
            q.new_empty(Nch, H, C, K),  # G2
            q.new_empty(Nch, H, C, C),  # X
            q.new_empty(Nch, H, C, C),  # P
            q.new_empty(Nch, H, C, K + V),  # WU
            q.new_empty(Nch, H, K, K),  # M
            q.new_empty(Nch, H, C, K),  # Qt
            q.new_empty(Nch, H, K, V),  # S_in
        )

    @torch.library.custom_op(f"{_OP_NAMESPACE}::chunk_kda_backward", mutates_args=())
    def backward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        G2: torch.Tensor,
        beta: torch.Tensor,
        X: torch.Tensor,
        P: torch.Tensor,
        WU: torch.Tensor,
        M: torch.Tensor,
        Qt: torch.Tensor,
        S_in: torch.Tensor,
        dO: torch.Tensor,
        dS_final: torch.Tensor | None,
        B: int,
        T: int,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        layout = _ChunkLayout(B, T, q.shape[2], cu_seqlens, q.device)
        return _chunk_backward(q, k, v, G2, beta, X, P, WU, M, Qt, S_in, dO, dS_final, layout)

    @backward.register_fake
    def _(q, k, v, G2, beta, X, P, WU, M, Qt, S_in, dO, dS_final, B, T, cu_seqlens):
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1  # the layout's sequences
        return (*(torch.empty_like(x) for x in (q, k, v, G2, beta)), q.new_empty(N, *S_in.shape[1:]))

    def setup_context(ctx, inputs, output):
        q, k, v, g, beta, S0, B, T, cu_seqlens, need_grad = inputs
        _, _, G2, X, P, WU, M, Qt, S_in = output
        ctx.save_for_backward(q, k, v, G2, beta, X, P, WU, M, Qt, S_in, cu_seqlens)
        ctx.B, ctx.T, ctx.need_grad = B, T, need_grad

    def backward_rule(ctx, dO, dS_final, *unused):
        if not ctx.need_grad:
            raise RuntimeError("chunk_kda: backward through a forward run without gradients (need_grad=False)")
        q, k, v, G2, beta, X, P, WU, M, Qt, S_in, cu_seqlens = ctx.saved_tensors
        grads = backward(q, k, v, G2, beta, X, P, WU, M, Qt, S_in, dO, dS_final, ctx.B, ctx.T, cu_seqlens)
        return (*grads, None, None, None, None)

    forward.register_autograd(backward_rule, setup_context=setup_context)
    return forward, backward


_chunk_kda_forward_op, _chunk_kda_backward_op = _define_ops()


def _chunk_torch(
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
    chunk_size=CHUNK_SIZE,
):
    """Chunked KDA on [B, T, H, *] inputs: layout, then `_chunk_forward` (exact, hand-written backward)."""
    if chunk_size < 2 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 2, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = _ChunkLayout(B, T, chunk_size, cu_seqlens, q.device)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    chunks = [layout.to_chunks(x) for x in (q, k, v, g, beta.unsqueeze(-1))]
    S0 = _initial(initial_state, layout.N, H, K, V, q)
    need_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (*chunks, S0))
    o, S, *_ = _chunk_kda_forward_op(*chunks, S0, B, T, cu_seqlens, need_grad)
    return layout.from_chunks(o), (S if output_final_state else None)
