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

This file belongs to the flat, Hub-copyable model folder: it needs nothing but torch.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
import torch.nn.functional as F

try:  # optional accelerator (kimi_hf_kernels, the repository's kernels/ folder); loads without it
    from kimi_hf_kernels.kda import recurrent_kda as _triton_recurrent_kda
except ImportError:
    _triton_recurrent_kda = None
try:
    from kimi_hf_kernels.kda import chunk_kda as _triton_chunk_kda
    from kimi_hf_kernels.kda.common import MAX_HEAD_DIM as _TRITON_MAX_HEAD_DIM  # whole K, V rows per tile
except ImportError:
    _triton_chunk_kda, _TRITON_MAX_HEAD_DIM = None, 0

__all__ = ["chunk_kda", "recurrent_kda", "naive_recurrent_kda", "l2norm", "kda_gate", "CHUNK_SIZE"]

CHUNK_SIZE = 64
BACKENDS = (None, "torch", "reference", "triton")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the fla / transformers form, not F.normalize)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """KDA's per-channel log-decay, in fp32: g = -exp(A_log[h]) * softplus(f + dt_bias).

    f: [B, T, H, K] (the low-rank forget projection); A_log: [H]; dt_bias: [H * K] or None.
    softplus is linear above 20 (torch's threshold), as in fla and transformers. No lower bound is
    applied: Kimi-Linear was trained without one, so g can be very negative.
    """
    H, K = f.shape[-2:]
    f = f.float()
    if dt_bias is not None:
        f = f + dt_bias.float().view(H, K)
    return -A_log.float().exp().view(H, 1) * F.softplus(f)


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
    """Checks A_log [H] and dt_bias [H * K] (or [H, K]) of the fused gate (use_gate_in_kernel)."""
    use_gate, A_log, dt_bias = gate_args
    H, K = q.shape[2:]
    if not use_gate:
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log and dt_bias are only used with use_gate_in_kernel=True (g is then the raw forget input)")
        return
    for name, x, shapes in (("A_log", A_log, [(H,)]), ("dt_bias", dt_bias, [(H * K,), (H, K)])):
        if x is None and name == "dt_bias":
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor with use_gate_in_kernel=True, got {type(x).__name__}")
        if tuple(x.shape) not in shapes or not x.is_floating_point() or x.device != q.device:
            raise ValueError(f"{name} must be a floating-point tensor of shape {' or '.join(map(str, map(list, shapes)))} "
                             f"on {q.device}, got {x.dtype} {list(x.shape)} on {x.device}")


def _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, gate_args=(False, None, None)) -> tuple[float, int]:
    """Validates the public arguments; returns (scale, number of sequences N)."""
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
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
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
            raise ValueError(f"g must be a log-decay (every value <= 0, no NaN), got a maximum of {top}; pass raw "
                             "forget inputs with use_gate_in_kernel=True, or compute g with kda_gate")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        want = (N, H, K, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must have shape [N, H, K, V] = {list(want)}, got {list(initial_state.shape)}")
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


# --------------------------------------------------------------------------------------------
# Token loop: the reference, and the decode path
# --------------------------------------------------------------------------------------------
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


def naive_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None, use_qk_l2norm=False):
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
        o, S = _token_loop(q[b : b + 1, s:e], k[b : b + 1, s:e], v[b : b + 1, s:e], g[b : b + 1, s:e], beta[b : b + 1, s:e], S0[n : n + 1])
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
    dst = torch.cat([torch.arange(s - cu[n], e - cu[n]) + n * L for n, (s, e) in enumerate(zip(cu, cu[1:]))]).to(q.device)

    def pad(x):
        flat = x.new_zeros(N * L, *x.shape[2:]).index_copy(0, dst, x[0].index_select(0, src))
        return flat.view(N, L, *x.shape[2:])

    o, S = _token_loop(*(pad(x) for x in (q, k, v, g, beta)), _initial(initial_state, N, H, K, V, q))
    o = o.reshape(N * L, H, V).index_select(0, dst).unsqueeze(0)
    return o, (S if output_final_state else None)


# --------------------------------------------------------------------------------------------
# Chunked PyTorch path
# --------------------------------------------------------------------------------------------
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


class _ChunkKDA(torch.autograd.Function):
    """Exact chunked KDA with a hand-written backward.

    Per chunk of C tokens, with G the chunk-local cumsum of g (every exponent used is <= 0):
        A_kk, A_qk: decayed k.k (j < i) and q.k (j <= i) scores, built level by level (see
                    `_level`), never as a [C, C, K] tensor;
        X = (I + Diag(beta) A_kk)^-1 by block forward substitution on the same levels;
        [W | U] = X [beta e^G k | beta v];   K_end = e^{G_C - G} k;
        M = Diag(e^{G_C}) - K_end^T W,  N = K_end^T U          (the chunk's state transition)
        o = (q e^G - A_qk W) S + A_qk U,  S' = M S + N           (S: the state entering the chunk)
    so the only sequential work is one [K, K] x [K, V] matmul per chunk, forward and backward.
    The backward recomputes the level factors instead of storing them (log2(C) times k's size).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, layout):
        """q, k, g [Nch, H, C, K] (q scaled); v [Nch, H, C, V]; beta [Nch, H, C, 1]; S0 [N, H, K, V]."""
        Nch, H, C, K = q.shape
        V = v.shape[-1]
        G2 = g.cumsum(2).mul_(_LOG2E)
        need_grad = any(ctx.needs_input_grad[:6])
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
        if need_grad:
            ctx.save_for_backward(q, k, v, G2, beta, X, P, WU, M, Qt, S_in)
            ctx.layout = layout
        return o, S_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO, dS_final):
        q, k, v, G2, beta, X, P, WU, M, Qt, S_in = ctx.saved_tensors
        layout, (Nch, H, C, K) = ctx.layout, q.shape
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
        return (*grads, dS0, None)


def _chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=None, use_qk_l2norm=False, chunk_size=CHUNK_SIZE):
    """Chunked KDA on [B, T, H, *] inputs: layout, then `_ChunkKDA` (exact, hand-written backward)."""
    if chunk_size < 2 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 2, got {chunk_size}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    layout = _ChunkLayout(B, T, chunk_size, cu_seqlens, q.device)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    chunks = [layout.to_chunks(x) for x in (q, k, v, g, beta.unsqueeze(-1))]
    o, S = _ChunkKDA.apply(*chunks, _initial(initial_state, layout.N, H, K, V, q), layout)
    return layout.from_chunks(o), (S if output_final_state else None)


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
        _warn_once("head-dim", f"kimi_hf: the Triton KDA kernels take head dims up to {_TRITON_MAX_HEAD_DIM}; using the PyTorch path")
        return torch_impl
    return triton_impl


def _run(impl, fused: bool, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
         use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel):
    """Calls an implementation; the gate activation and sigmoid(beta) are fused into the Triton
    kernels and applied here, in fp32 and differentiably, for the others."""
    kw = dict(cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    if fused:
        kw.update(A_log=A_log if use_gate_in_kernel else None, dt_bias=dt_bias if use_gate_in_kernel else None,
                  use_beta_sigmoid=use_beta_sigmoid_in_kernel)
    else:
        if use_gate_in_kernel:
            g = kda_gate(g, A_log, None if dt_bias is None else dt_bias.reshape(-1))
        if use_beta_sigmoid_in_kernel:
            beta = torch.sigmoid(beta.to(_compute_dtype(q)))
    # autocast would turn the fp32 gate / state arithmetic's matmuls into bf16 halfway: the op picks its
    # own compute dtype from the inputs instead
    with torch.autocast(q.device.type, enabled=False):
        o, S = impl(q, k, v, g, beta, scale, initial_state, output_final_state, **kw)
    return o.to(q.dtype), S


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm=False, backend=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              use_beta_sigmoid_in_kernel=False):
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
        use_gate_in_kernel: g is the raw forget input f; the decay -exp(A_log) * softplus(f + dt_bias)
            is computed inside (A_log [H], dt_bias [H * K] or None). fla's argument names.
        use_beta_sigmoid_in_kernel: beta holds logits; sigmoid(beta) is computed inside.
    Returns:
        o [B, T, H, V] in q's dtype, and the final state [N, H, K, V] float32 (or None).
    """
    scale, _ = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, (use_gate_in_kernel, A_log, dt_bias))
    impl = _select(backend, q, v, _triton_chunk_kda, _chunk_torch)
    return _run(impl, impl is _triton_chunk_kda, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                use_qk_l2norm, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  use_qk_l2norm=False, backend=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                  use_beta_sigmoid_in_kernel=False):
    """Kimi Delta Attention by the token loop: the decode path (one or a few tokens per call,
    state in and out). Same arguments and results as `chunk_kda`."""
    scale, _ = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, backend, (use_gate_in_kernel, A_log, dt_bias))
    impl = _select(backend, q, v, _triton_recurrent_kda, _recurrent_torch)
    if impl is _triton_recurrent_kda and torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state, A_log, dt_bias)):
        impl = _recurrent_torch  # the fused recurrent kernel is forward-only
    return _run(impl, impl is _triton_recurrent_kda, q, k, v, g, beta, scale, initial_state, output_final_state,
                cu_seqlens, use_qk_l2norm, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
