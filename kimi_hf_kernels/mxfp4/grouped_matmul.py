"""Grouped expert matmul with MXFP4 weights (OCP MX v1.0 MXFP4, compressed-tensors' mxfp4-pack-quantized layout):

    forward  (TRANSPOSE=False): y[rows of e] = x[rows of e] @ W_e^T      x [S, in]  -> y [S, out]
    backward (TRANSPOSE=True):  dx[rows of e] = dy[rows of e] @ W_e      dy [S, out] -> dx [S, in]

W_e [out, in] is expert e of packed [E, out, in / 2] uint8 (element 2j of a row in the low nibble of byte j) and
scale [E, out, in / 32] uint8 (E8M0: 2^(s - 127) for the 32 inputs of a block). The rows of x are grouped by expert
(counts[e] consecutive rows for e); each program takes one tile of BM rows of one expert (a host-built tile table:
expert, first row, the expert's end row) and BN output columns, and walks the reduction dim in steps of BK. Weight
tiles are decoded in registers, never written out: each element's nibble and its block's scale byte are read and
turned into the fp32 bit pattern of E2M1(code) * 2^(s - 127) by integer arithmetic (exact: at most 2 significant
bits; a value below fp32's normal range goes through a float multiply, which a GPU may flush to zero: no real
weight is that small), then cast to the activations' dtype (exact for bf16) for tl.dot with an fp32 accumulator
(fp32 activations: IEEE fp32 dot, no TF32). Same numbers as dequantise-then-matmul up to the summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kda.common import INTERPRET


# (BN, BK, warps) tried by the autotuner on a GPU: the sm_90 bf16 builds of these keep every register (no spills), at
# every BM (`python -m kimi_hf_kernels.mxfp4.compile_check` builds each one); one small config under the interpreter
GPU_CONFIGS = tuple(
    triton.Config({"BN": n, "BK": k}, num_warps=w, num_stages=2)
    for n, k, w in ((64, 32, 4), (64, 32, 8), (128, 32, 8), (64, 64, 8), (32, 64, 8))
)
CONFIGS = [triton.Config({"BN": 32, "BK": 32}, num_warps=1)] if INTERPRET else list(GPU_CONFIGS)
# BM, the rows of a tile (one expert's): the smallest that holds the largest expert's rows, else the last (a call's
# constant, so each autotuned config is built once per BM used)
BLOCK_ROWS = (16, 32, 64)


@triton.jit
def _weight_tile(packed, scale, e, rows, cols, OUT, IN, mask):
    """W_e[rows, cols] in fp32 for broadcastable int index tensors rows (< OUT) / cols (< IN); 0 where ~mask."""
    r = e.to(tl.int64) * OUT + rows.to(tl.int64)
    byte = tl.load(packed + r * (IN // 2) + cols // 2, mask=mask, other=0).to(tl.int32)
    s = tl.load(scale + r * (IN // 32) + cols // 32, mask=mask, other=127).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)) & 15
    mag = code & 7  # E2M1 magnitude code: exponent bits ex = mag >> 1, mantissa bit man = mag & 1
    ex = mag >> 1
    man = mag & 1
    # normal magnitudes (1 + man / 2) * 2^(ex - 1) (ex >= 1) and 0.5 (mag 1) times 2^(s - 127): fp32 exponent field
    # s + ex - 1, mantissa bit 22 = man for ex >= 1
    field = s + ex - 1
    bits = (field << 23) | (tl.where(ex > 0, man, 0) << 22)
    value = bits.to(tl.float32, bitcast=True)
    e2m1 = tl.where(
        ex == 0, man.to(tl.float32) * 0.5, (1.0 + man.to(tl.float32) * 0.5) * (1 << (ex - 1)).to(tl.float32)
    )
    tiny = e2m1 * tl.exp2((s - 127).to(tl.float32))  # below fp32's normals (never in a real weight)
    value = tl.where(field < 1, tiny, value)
    value = tl.where(field > 254, float("inf"), value)
    value = tl.where(mag == 0, 0.0, value)
    value = tl.where(s == 255, float("nan"), value)
    return tl.where(code >= 8, -value, value)


@triton.autotune(configs=CONFIGS, key=["OUT", "IN", "BM", "TRANSPOSE", "FP32"])
@triton.jit
def mxfp4_grouped_matmul_kernel(
    a,
    packed,
    scale,
    y,
    tile_expert,
    tile_row,
    tile_end,
    OUT,
    IN,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    FP32: tl.constexpr,
):
    t, j = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert + t)
    row0 = tl.load(tile_row + t).to(tl.int64)
    end = tl.load(tile_end + t).to(tl.int64)
    if TRANSPOSE:
        RED, COLS = OUT, IN
    else:
        RED, COLS = IN, OUT
    o_m = row0 + tl.arange(0, BM)
    m_m = o_m < end
    o_n = j * BN + tl.arange(0, BN)
    m_n = o_n < COLS
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, RED, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < RED
        b_a = tl.load(a + o_m[:, None] * RED + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        mask = m_k[:, None] & m_n[None, :]
        if TRANSPOSE:  # [BK, BN] = W_e[k, n]
            w = _weight_tile(packed, scale, e, o_k[:, None], o_n[None, :], OUT, IN, mask)
        else:  # [BK, BN] = W_e^T[k, n] = W_e[n, k]
            w = _weight_tile(packed, scale, e, o_n[None, :], o_k[:, None], OUT, IN, mask)
        if FP32:
            acc += tl.dot(b_a, w, input_precision="ieee")
        else:
            acc += tl.dot(b_a, w.to(b_a.dtype))
    tl.store(y + o_m[:, None] * COLS + o_n[None, :], acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _tiles(counts: list[int], BM: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile table: for each tile of BM rows (of one expert), its expert, first row and the expert's end row."""
    n = torch.tensor(counts, dtype=torch.int64)
    tiles = (n + BM - 1) // BM
    start = torch.cumsum(n, 0) - n
    expert = torch.repeat_interleave(torch.arange(len(counts)), tiles)
    within = torch.arange(int(tiles.sum())) - torch.repeat_interleave(torch.cumsum(tiles, 0) - tiles, tiles)
    row = start[expert] + within * BM
    end = (start + n)[expert]
    return tuple(t.to(device=device, dtype=torch.int32) for t in (expert, row, end))


def mxfp4_grouped_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, counts: list[int], transpose: bool = False
) -> torch.Tensor:
    """x [S, in] -> [S, out] (x @ W_e^T per group), or with transpose x [S, out] -> [S, in] (x @ W_e). counts: E
    row counts (Python ints) summing to S; packed [E, out, in / 2] / scale [E, out, in / 32] uint8. In x's dtype
    (fp32 / fp16 / bf16)."""
    E, OUT, half = packed.shape
    IN = 2 * half
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be fp32 / fp16 / bf16, got {x.dtype}")
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous()
    cols = IN if transpose else OUT
    y = x.new_empty(x.shape[0], cols)
    if x.shape[0] == 0:
        return y
    most = max(counts)
    BM = next((bm for bm in BLOCK_ROWS if most <= bm), BLOCK_ROWS[-1])
    expert, row, end = _tiles(counts, BM, x.device)

    def grid(meta):
        return (expert.numel(), triton.cdiv(cols, meta["BN"]))

    mxfp4_grouped_matmul_kernel[grid](
        x, packed, scale, y, expert, row, end, OUT, IN, BM=BM, TRANSPOSE=transpose, FP32=x.dtype == torch.float32
    )
    return y
