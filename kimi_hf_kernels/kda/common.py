"""Shared pieces of the Triton KDA kernels: autotune spaces, chunk tables and tile helpers.

Tensors are token-major: q, k, g [T, H, K], v [T, H, V], beta [T, H] with T = all tokens of the
batch (B * T, or the packed length with cu_seqlens). Every sequence starts a new chunk of C = 64
tokens; a chunk is described by its first token and its length (<= C, shorter at a sequence's end).
Per-chunk square matrices (A, P, X and their gradients) are stored row by row next to the tokens:
[T, H, C], entry (t, h, c) = row t - bos of the chunk's matrix, column c.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CHUNK = 64  # tokens per chunk
SUB = 16  # tokens per sub-chunk: the granularity of the anchored exponents and of the inverse
MAX_HEAD_DIM = 256  # whole K (and V) rows sit in one tile: the fused L2 norm needs full rows
# Column block of the kernels that loop over K or V themselves (the interpreter's tests, with head
# dims of 16-40, then cover several blocks).
INNER_BLOCK = 16 if INTERPRET else 32


def configs(space: dict, interpret: dict | None = None) -> list:
    """Autotune configs: the product of `space` (meta-parameters) with warps/stages on a GPU, one
    fixed config under TRITON_INTERPRET=1 (there is no driver to benchmark with)."""
    if INTERPRET:
        return [triton.Config(dict(interpret or {}), num_warps=1)]
    out = [{}]
    for name, values in space.items():
        out = [dict(c, **{name: v}) for c in out for v in values]
    # a small space: every config is compiled on first use (the registers/spills of each kernel
    # at 4 and 8 warps are listed by `python -m kimi_hf_kernels.kda.compile_check`)
    return [triton.Config(c, num_warps=w, num_stages=2) for c in out for w in (4, 8)]


class ChunkTables:
    """Chunk bookkeeping for B equal-length sequences or packed ones (cu_seqlens).

    bos [NCH] int32: first token of every chunk; length [NCH] int32: its number of tokens;
    seq [N + 1] int32: chunks of sequence n are seq[n] .. seq[n + 1] - 1.
    """

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device):
        if cu_seqlens is None:
            starts, lens = [b * T for b in range(B)], [T] * B
        else:
            cu = cu_seqlens.tolist()
            starts, lens = cu[:-1], [e - s for s, e in zip(cu, cu[1:])]
        bos, length, seq = [], [], [0]
        for s, n in zip(starts, lens):
            for c in range(0, n, CHUNK):
                bos.append(s + c)
                length.append(min(CHUNK, n - c))
            seq.append(len(bos))
        self.N, self.num_chunks = len(lens), len(bos)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
        self.bos, self.length, self.seq = as_tensor(bos), as_tensor(length), as_tensor(seq)


@triton.jit
def load_rows(ptr, t0, n, i_h, col0, H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """[BR, BD] fp32 tile of a token-major [T, H, D] tensor: rows t0 + [0, BR) at head i_h, columns
    col0 + [0, BD). Rows >= n (past the chunk) and columns >= D read 0."""
    r = tl.arange(0, BR)
    d = col0 + tl.arange(0, BD)
    p = ptr + ((t0 + r).to(tl.int64) * H + i_h)[:, None] * D + d[None, :]
    return tl.load(p, mask=(r < n)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def store_rows(ptr, x, t0, n, i_h, col0, H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """Stores a [BR, BD] tile at the position `load_rows` reads (rows < n, columns < D only)."""
    r = tl.arange(0, BR)
    d = col0 + tl.arange(0, BD)
    p = ptr + ((t0 + r).to(tl.int64) * H + i_h)[:, None] * D + d[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=(r < n)[:, None] & (d < D)[None, :])


@triton.jit
def load_cumgate(G, t0, n, i_h, H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """[BR, BK] tile of the chunk-local cumulative gate G, rows past the chunk clamped to its last
    row (n - 1 may be negative: the tile then lies wholly past the chunk's end). The padding thus
    carries the chunk's final G, so exp(G_row - G_anchor) <= 1 holds for padded rows too."""
    return load_cumgate_cols(G, t0, n, i_h, 0, H, K, BR, BK)


@triton.jit
def load_cumgate_cols(G, t0, n, i_h, col0, H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """`load_cumgate` restricted to the columns col0 + [0, BK)."""
    r = tl.minimum(tl.arange(0, BR), n - 1)
    d = col0 + tl.arange(0, BK)
    p = G + ((t0 + r).to(tl.int64) * H + i_h)[:, None] * K + d[None, :]
    return tl.load(p, mask=(d < K)[None, :], other=0.0)


@triton.jit
def load_cumgate_row(G, t, i_h, col0, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """[BK] row of G at token t (columns col0 + [0, BK))."""
    d = col0 + tl.arange(0, BK)
    return tl.load(G + (t.to(tl.int64) * H + i_h) * K + d, mask=d < K, other=0.0)


@triton.jit
def qk_row_scale(
    ptr, t0, n, i_h, H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BKB: tl.constexpr, L2NORM: tl.constexpr
):
    """[BR] factor 1 / sqrt(sum x^2 + 1e-6) of the fused L2 norm of rows t0 + [0, BR) (ones when off),
    summed over K in blocks of BKB: kernels that work on K in blocks apply it to each block."""
    f = tl.full([BR], 1.0, dtype=tl.float32)
    if L2NORM:
        ss = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, K, BKB):
            x = load_rows(ptr, t0, n, i_h, c0, H, K, BR, BKB)
            ss += tl.sum(x * x, 1)
        f = 1.0 / tl.sqrt(ss + 1e-6)
    return f


@triton.jit
def load_qk(
    ptr, t0, n, i_h, H: tl.constexpr, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, L2NORM: tl.constexpr
):
    """A q or k tile in fp32, L2-normalised per row as x / sqrt(sum x^2 + 1e-6) when L2NORM."""
    x = load_rows(ptr, t0, n, i_h, 0, H, K, BR, BK)
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
    return x


@triton.jit
def l2norm_bwd(x, dy, L2NORM: tl.constexpr):
    """Gradient w.r.t. the raw rows x given dy w.r.t. y = x / r, r = sqrt(sum x^2 + 1e-6):
    dx = (dy - y (y . dy)) / r (the identity when L2NORM is off)."""
    if L2NORM:
        r = tl.sqrt(tl.sum(x * x, 1) + 1e-6)
        y = x / r[:, None]
        dy = (dy - y * tl.sum(y * dy, 1)[:, None]) / r[:, None]
    return dy


@triton.jit
def load_beta(beta, t0, n, i_h, H: tl.constexpr, BR: tl.constexpr, SIGMOID: tl.constexpr):
    """[BR] fp32 beta of rows t0 + [0, BR) (0 past the chunk), sigmoid applied when SIGMOID."""
    r = tl.arange(0, BR)
    b = tl.load(beta + (t0 + r).to(tl.int64) * H + i_h, mask=r < n, other=0.0).to(tl.float32)
    if SIGMOID:
        b = tl.where(r < n, tl.sigmoid(b), 0.0)
    return b


@triton.jit
def softplus(x):
    """log(1 + e^x), linear above 20 (torch's threshold, as in fla and transformers)."""
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def gate_scale(A_log, i_h, HAS_A: tl.constexpr):
    """The per-head scale a = exp(A_log[i_h]) of the fused gate, in fp32 (1 without A_log: the safe gate
    takes A_log = None, as in fla). Loaded once per program, outside the token loops."""
    a = 1.0
    if HAS_A:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    return a


@triton.jit
def gate_fwd(x, a, lower_bound, SAFE_GATE: tl.constexpr):
    """The fused gate on an fp32 tile x = f + dt_bias, a = `gate_scale`: the log-decay g <= 0 (the Triton
    kernels' one statement of it; PyTorch's is kimi_hf.ops.kda_inputs.kda_gate, the same formulas).

    SAFE_GATE (Kimi K3, fla's safe_gate): g = lower_bound * sigmoid(a x), in [lower_bound, 0].
    Otherwise (Kimi-Linear): g = -a softplus(x).
    """
    if SAFE_GATE:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        g = -a * softplus(x)
    return g


@triton.jit
def gate_bwd(x, dg, a, lower_bound, SAFE_GATE: tl.constexpr):
    """Backward of `gate_fwd` given dg, the gradient w.r.t. g: returns (dx, dl). dx is the gradient w.r.t.
    x = f + dt_bias (each token's share of dt_bias's, too); dl = dg * dg/dA_log per element, to be summed
    over tokens and channels (meaningless without A_log: a = 1 then is a constant).

    SAFE_GATE: with z = a x and s = sigmoid(z), dg/dz = lower_bound s (1 - s); dz/dx = a, dz/dA_log = z
    (da/dA_log = a). Otherwise: dg/dx = -a sigmoid(x) and dg/dA_log = g = -a softplus(x).
    """
    if SAFE_GATE:
        z = a * x
        s = tl.sigmoid(z)
        dz = dg * (lower_bound * s * (1.0 - s))
        dx = dz * a
        dl = dz * z
    else:
        dx = dg * -a * tl.sigmoid(x)
        dl = dg * -a * softplus(x)
    return dx, dl


@triton.jit
def load_block(ptr, t0, n, i_h, col0, H: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """[BR, BC] block of a per-chunk [T, H, BT] matrix: rows t0 + [0, BR), columns col0 + [0, BC)."""
    return load_rows(ptr, t0, n, i_h, col0, H, BT, BR, BC)


@triton.jit
def store_block(ptr, x, t0, n, i_h, col0, H: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    store_rows(ptr, x, t0, n, i_h, col0, H, BT, BR, BC)


@triton.jit
def state_ptrs(
    ptr, i_c, i_h, k0, i_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):
    """Pointers and mask of the [BK, BV] block (rows k0 + [0, BK), value block i_v) of state i_c
    (head i_h) of a [*, H, K, V] tensor."""
    o_k = k0 + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    p = ptr + (i_c * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    return p, (o_k < K)[:, None] & (o_v < V)[None, :]
