"""The MXFP4 codec of Kimi K3's routed experts (compressed-tensors `mxfp4-pack-quantized`, OCP MX v1.0
MXFP4): hand-packed bytes, an independent packer, exact re-packing, the MX rounding rule against an fp64
reference, and the input checks naming the tensor."""

import contextlib
import math
import re

import pytest
import torch

from kimi_hf.ops import mxfp4 as mx
from kimi_hf.ops.mxfp4 import ZERO_GROUP_SCALE, dequantize_mxfp4, quantize_mxfp4


LUT = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
NAME = "language_model.model.layers.3.block_sparse_moe.experts.7.w1"


def e2m1(code: int) -> float:
    """The spec's formula, one code at a time: (-1)^sign * LUT[magnitude]."""
    return (-1.0 if (code >> 3) & 1 else 1.0) * LUT[code & 7]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., in] codes (0..15) -> [..., in / 2] bytes, element 2j in the low nibble, with explicit bit ops."""
    lo, hi = codes[..., 0::2].to(torch.uint8), codes[..., 1::2].to(torch.uint8)
    return (lo & 0x0F) | ((hi & 0x0F) << 4)


def expected_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp64 reference: e2m1(code) * 2^(s - 127), the scale repeated over its 32 columns."""
    table = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
    powers = torch.tensor([math.ldexp(1.0, s - 127) for s in range(256)], dtype=torch.float64)
    return table[codes.long()] * powers[scale.long()].repeat_interleave(32, dim=-1)


@contextlib.contextmanager
def flush_denormal(on: bool):
    """torch.set_flush_denormal(on) for the block, then the previous mode back (the test session turns
    flushing on; the codec must be exact either way)."""
    before = torch.tensor(1e-40, dtype=torch.float32).item() == 0.0  # a flushed subnormal: flushing is on
    torch.set_flush_denormal(on)
    try:
        yield
    finally:
        torch.set_flush_denormal(before)


def row(*bytes_):
    """One row of 16 bytes (32 elements, one scale group): the given bytes, then zeros."""
    return torch.tensor([list(bytes_) + [0] * (16 - len(bytes_))], dtype=torch.uint8)


def scales(*s):
    return torch.tensor([list(s)], dtype=torch.uint8)


def test_hand_packed_bytes():
    # 0x2F: low nibble 0xF (sign, magnitude 7: -6) is element 0; high nibble 0x2 (+1.0) element 1
    w = dequantize_mxfp4(row(0x2F, 0x73, 0x5E), scales(127))
    assert w.dtype == torch.bfloat16 and w.shape == (1, 32)
    assert w[0, :6].tolist() == [-6.0, 1.0, 1.5, 6.0, -4.0, 3.0]
    assert dequantize_mxfp4(row(0x2F), scales(128))[0, :2].tolist() == [-12.0, 2.0]  # scale 2^1
    assert dequantize_mxfp4(row(0x2F), scales(126))[0, :2].tolist() == [-3.0, 0.5]  # scale 2^-1
    # the sign bit alone: 0x1 / 0x9 are +0.5 / -0.5
    assert dequantize_mxfp4(row(0x91), scales(127))[0, :2].tolist() == [0.5, -0.5]
    # zero codes 0x0 / 0x8: +0 / -0 (the sign survives into bf16)
    z = dequantize_mxfp4(row(0x80, 0x08), scales(127), dtype=torch.float32)[0, :4]
    assert z.tolist() == [0.0, 0.0, 0.0, 0.0] and torch.signbit(z).tolist() == [False, True, True, False]
    # the scale is per 32 consecutive elements of a row: in = 64 has two
    two = dequantize_mxfp4(torch.cat([row(0x22), row(0x22)], dim=1), scales(127, 129))
    assert two[0, :2].tolist() == [1.0, 1.0] and two[0, 32:34].tolist() == [4.0, 4.0]


def test_every_byte_and_scale_decodes_exactly():
    # all 256 bytes: (element 2j, element 2j + 1) = (low nibble, high nibble)
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)
    w = dequantize_mxfp4(packed, torch.full((16, 1), 127, dtype=torch.uint8), dtype=torch.float64)
    assert w.view(-1, 2).tolist() == [[e2m1(b & 15), e2m1(b >> 4)] for b in range(256)]
    # every scale byte 0 .. 252 with every magnitude: bf16 and fp32 hold the values exactly, also the
    # subnormal 0.5 * 2^-127 = 2^-128; compared bit for bit, decoded with flushing off and on
    s = torch.arange(253, dtype=torch.uint8)[:, None]
    packed = row(0x10, 0x32, 0x54, 0x76).expand(253, 16)
    values = [[math.ldexp(LUT[k], int(b) - 127) for k in range(8)] for b in s.view(-1)]
    views = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    with flush_denormal(False):
        want = {dtype: torch.tensor(values, dtype=torch.float64).to(dtype).view(v) for dtype, v in views.items()}
    assert (want[torch.bfloat16][0] != 0).sum() == 7  # the scale byte 0 row really is subnormal, not 0
    for flushing in (False, True):
        with flush_denormal(flushing):
            for dtype, v in views.items():
                got = dequantize_mxfp4(packed, s, dtype=dtype)[:, :8].view(v)
                assert torch.equal(got, want[dtype]), (dtype, flushing)
    # fp64 holds the largest, 6 * 2^127, too; scale byte 255 is E8M0's NaN
    assert dequantize_mxfp4(row(0x07), scales(254), dtype=torch.float64)[0, 0].item() == math.ldexp(6.0, 127)
    assert dequantize_mxfp4(row(0x21), scales(255)).isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float16])
def test_random_codes_round_trip_through_an_independent_packer(dtype):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 96), generator=g)  # a leading expert dim
    # fp16 holds 2^-14 .. 2^15 (6 * 2^12 at most here); the others the checkpoint's range and more
    lo, hi = (120, 131) if dtype == torch.float16 else (100, 150)
    scale = torch.randint(lo, hi, (3, 5, 3), generator=g, dtype=torch.uint8)
    w = dequantize_mxfp4(pack(codes), scale, dtype=dtype)
    want = expected_values(codes, scale)
    assert w.shape == (3, 5, 96) and w.dtype == dtype
    assert torch.equal(w.double(), want)
    assert torch.equal(torch.signbit(w), torch.signbit(want))  # the zeros' signs too


def test_leading_dims_and_row_blocks(monkeypatch):
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (4, 7, 32), generator=g, dtype=torch.uint8)
    scale = torch.randint(115, 140, (4, 7, 2), generator=g, dtype=torch.uint8)
    whole = dequantize_mxfp4(packed, scale)
    assert whole.shape == (4, 7, 64)
    for e in range(4):  # experts decode independently
        assert torch.equal(whole[e], dequantize_mxfp4(packed[e], scale[e]))
    monkeypatch.setattr(mx, "_BLOCK_ELEMENTS", 3 * 64)  # 3 rows a block: 28 rows are 9 blocks and a rest
    assert torch.equal(dequantize_mxfp4(packed, scale), whole)
    assert torch.equal(dequantize_mxfp4(packed, scale, dtype=torch.float16), whole.half())
    p, s = quantize_mxfp4(whole * 1.3, exact=False)  # rounding, in blocks
    monkeypatch.undo()
    p1, s1 = quantize_mxfp4(whole * 1.3, exact=False)
    assert torch.equal(p, p1) and torch.equal(s, s1)
    assert p.shape == (4, 7, 32) and s.shape == (4, 7, 2) and p.dtype == s.dtype == torch.uint8


def representable_codes(shape, generator):
    """Random codes whose every 32-group has a largest magnitude 4 or 6 (what the MX and compressed-tensors
    writers produce), so the scale byte round trips too."""
    codes = torch.randint(0, 16, shape, generator=generator)
    groups = codes.view(*shape[:-1], -1, 32)
    slot = torch.randint(0, 32, groups.shape[:-1], generator=generator)
    sign = torch.randint(0, 2, slot.shape, generator=generator) << 3
    top = torch.randint(6, 8, slot.shape, generator=generator) | sign
    groups.scatter_(-1, slot[..., None], top[..., None])
    return codes


def test_quantize_inverts_dequantize():
    g = torch.Generator().manual_seed(2)
    codes = representable_codes((3, 6, 128), g)
    scale = torch.randint(100, 150, (3, 6, 4), generator=g, dtype=torch.uint8)
    scale[0, 0, 0] = 0  # the lowest scale byte, subnormal values included
    packed = pack(codes)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        p, s = quantize_mxfp4(dequantize_mxfp4(packed, scale, dtype=dtype), name=NAME)
        assert torch.equal(p, packed) and torch.equal(s, scale), dtype
    # float16 holds the scales 2^-14 .. 2^9 here (its subnormals too, read from their bits)
    scale16 = torch.randint(113, 137, (3, 6, 4), generator=g, dtype=torch.uint8)
    p, s = quantize_mxfp4(dequantize_mxfp4(packed, scale16, dtype=torch.float16))
    assert torch.equal(p, packed) and torch.equal(s, scale16)
    # a non-contiguous weight (a transposed view) packs like its contiguous copy
    w = dequantize_mxfp4(packed, scale)
    p, s = quantize_mxfp4(w.transpose(-1, -2).contiguous().transpose(-1, -2))
    assert torch.equal(p, packed) and torch.equal(s, scale)


def test_groups_the_scale_byte_cannot_tell_apart():
    # at scale byte 0 every group round trips, whatever its largest code
    small = pack(torch.tensor([[1, 9, 3, 2] + [0] * 28]))
    assert quantize_mxfp4(dequantize_mxfp4(small, scales(0)))[1].item() == 0
    # codes within [-3, 3]: the same values at the next smaller scale byte with doubled codes
    codes = torch.tensor([[5, 3, 2, 13, 1] + [0] * 27])  # 3, 1.5, 1, -3, 0.5
    w = dequantize_mxfp4(pack(codes), scales(130))
    p, s = quantize_mxfp4(w)
    assert s.item() == 129 and torch.equal(dequantize_mxfp4(p, s), w)
    assert p[0, :3].tolist() == [7 | 5 << 4, 4 | 15 << 4, 2]  # (6, 3), (2, -6), (1, 0)
    # all-zero groups: ZERO_GROUP_SCALE (or zero_scale), the zeros' signs kept (codes 0 / 8)
    zeros = pack(torch.tensor([[0, 8, 8, 0] + [0] * 28]))
    w = dequantize_mxfp4(zeros, scales(120))
    p, s = quantize_mxfp4(w)
    assert torch.equal(p, zeros) and s.item() == ZERO_GROUP_SCALE == 0
    assert torch.equal(torch.signbit(dequantize_mxfp4(p, s)), torch.signbit(w))
    assert quantize_mxfp4(w, zero_scale=127)[1].item() == 127


def reference_quantize(w: torch.Tensor) -> tuple[list, list]:
    """The OCP MX v1.0 conversion, element by element in Python floats (fp64): shared exponent
    floor(log2(amax)) - 2 clamped to [-127, 127]; each value / 2^e to the nearest E2M1 value, ties to the
    even code (mantissa bit 0), above 6 clamped to 6. Returns (codes per row, scale bytes per row)."""
    all_codes, all_scales = [], []
    for values in w.double().view(-1, w.shape[-1]).tolist():
        codes, row_scales = [], []
        for g0 in range(0, len(values), 32):
            group = values[g0 : g0 + 32]
            amax = max(abs(v) for v in group)
            if amax == 0:
                e = ZERO_GROUP_SCALE - 127
            else:
                e = min(max(math.floor(math.log2(amax)) - 2, -127), 127)
            row_scales.append(e + 127)
            for v in group:
                x = abs(v) / 2.0**e
                dist = [abs(x - c) for c in LUT]
                best = min(dist)
                ties = [k for k in range(8) if dist[k] == best]
                k = 7 if x > 6 else (ties[0] if len(ties) == 1 else next(k for k in ties if k % 2 == 0))
                codes.append(k | (8 if math.copysign(1.0, v) < 0 else 0))
        all_codes.append(codes)
        all_scales.append(row_scales)
    return all_codes, all_scales


def test_rounding_matches_the_fp64_reference():
    g = torch.Generator().manual_seed(3)
    # groups of very different magnitudes, in bf16 like a fine-tuned expert
    magnitude = torch.logspace(-6, 3, 64).view(8, 8, 1).expand(8, 8, 32).reshape(8, 256)
    w = torch.randn(8, 256, generator=g) * magnitude
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, -0.75, -5.0, -7.5, 0.1, -0.0, 4.0, 1.0])
    w[0, :16] = ties  # amax 7.5 -> e = 0: the midpoints of the E2M1 grid themselves, and saturation
    w[1, :32] = torch.tensor([3.5] + [0.875] * 31)  # amax 3.5 -> e = -1: ties at 7 (saturates) and 1.75
    w = w.bfloat16()
    p, s = quantize_mxfp4(w, name=NAME, exact=False)
    codes, row_scales = reference_quantize(w)
    assert s.tolist() == row_scales
    assert torch.equal(p, pack(torch.tensor(codes)))
    # fp64 weights beyond the E8M0 range clamp the scale byte (to 0 / 254) and saturate
    big = torch.tensor([[1e-45, -3e-45] + [0.0] * 30 + [1e60, -2e40] + [0.0] * 30], dtype=torch.float64)
    p, s = quantize_mxfp4(big, exact=False)
    codes, row_scales = reference_quantize(big)
    assert s.tolist() == row_scales == [[0, 254]] and torch.equal(p, pack(torch.tensor(codes)))
    # the exact mode refuses all of these, naming the tensor
    with pytest.raises(ValueError, match=re.escape(NAME) + ".*exact=False"):
        quantize_mxfp4(w, name=NAME)
    with pytest.raises(ValueError, match=re.escape(NAME)):
        quantize_mxfp4(big, name=NAME)


@pytest.mark.parametrize("flushing", [False, True], ids=["denormals", "flush_to_zero"])
def test_exact_mode_sees_a_subnormal_value(flushing):
    # fp32 2^-140 (a subnormal, made from its bits) next to 2^127 (scale 2^125): no E2M1 code times 2^125.
    # It is read from its bits, so it counts even where the process flushes denormals to zero.
    w = torch.zeros(1, 32)
    w[0, 0] = math.ldexp(1.0, 127)
    w[0, 1] = torch.tensor(1 << 9, dtype=torch.int32).view(torch.float32)  # 2^9 * 2^-149
    with flush_denormal(flushing):
        with pytest.raises(ValueError, match="row 0, column 1"):
            quantize_mxfp4(w)
        # alone in its group, at scale byte 0 a subnormal code * 2^-127 re-packs exactly
        tiny = torch.zeros(1, 32, dtype=torch.int32)
        tiny[0, :2] = torch.tensor([1 << 21, (1 << 31) + (3 << 21)])  # 2^-128, -1.5 * 2^-127
        p, s = quantize_mxfp4(tiny.view(torch.float32))
        assert s.item() == 0 and p[0, 0].item() == 1 | (8 | 3) << 4


def bad_inputs():
    u8 = torch.uint8
    ok_p, ok_s = torch.zeros(4, 16, dtype=u8), torch.zeros(4, 1, dtype=u8)
    return [
        ("packed_dtype", ok_p.to(torch.int8), ok_s, {}, "weight_packed must be uint8"),
        ("scale_dtype", ok_p, ok_s.float(), {}, "weight_scale must be uint8"),
        ("rank", ok_p[None], ok_s, {}, "differ in rank"),
        ("one_dim", ok_p[0], ok_s[0], {}, r"must be \[\.\.\., out, width\]"),
        ("leading_dims", torch.zeros(2, 4, 16, dtype=u8), torch.zeros(3, 4, 1, dtype=u8), {}, "before the last dim"),
        ("rows", ok_p, torch.zeros(5, 1, dtype=u8), {}, "before the last dim"),
        ("odd_width", torch.zeros(4, 15, dtype=u8), ok_s, {}, "width 15 is odd"),
        ("width_not_16", torch.zeros(4, 24, dtype=u8), torch.zeros(4, 1, dtype=u8), {}, "not a multiple of 16"),
        ("scale_width", torch.zeros(4, 32, dtype=u8), ok_s, {}, "weight_scale width 1 must be in / 32 = 2"),
        ("expected_shape", ok_p, ok_s, {"expected_shape": (4, 64)}, r"expected \[4, 64\]"),
        ("expected_rows", ok_p, ok_s, {"expected_shape": (3, 32)}, r"expected \[3, 32\]"),
        ("expected_in", ok_p, ok_s, {"expected_shape": (4, 33)}, "expected in = 33 is not a multiple of 32"),
        ("dtype", ok_p, ok_s, {"dtype": torch.int32}, "dtype must be a floating torch.dtype"),
    ]


@pytest.mark.parametrize(
    "packed,scale,kwargs,message", [b[1:] for b in bad_inputs()], ids=[b[0] for b in bad_inputs()]
)
def test_dequantize_errors_name_the_tensor(packed, scale, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(NAME) + ": .*" + message):
        dequantize_mxfp4(packed, scale, name=NAME, **kwargs)


@pytest.mark.parametrize(
    "weight,kwargs,message",
    [
        (torch.zeros(4, 32, dtype=torch.int32), {}, "expected a floating weight"),
        (torch.zeros(32), {}, r"expected a weight \[\.\.\., out, in\]"),
        (torch.zeros(4, 33), {}, "in = 33 is odd"),
        (torch.zeros(4, 48), {}, "in = 48 is not a multiple of 32"),
        (torch.full((4, 32), math.inf), {}, "non-finite value at row 0, column 0"),
        (torch.full((4, 32), 5.0), {}, "not MXFP4-representable"),
        (torch.zeros(4, 32), {"zero_scale": 255}, "not an E8M0 scale byte"),
    ],
    ids=["int", "one_dim", "odd_in", "in_not_32", "inf", "not_representable", "zero_scale"],
)
def test_quantize_errors_name_the_tensor(weight, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(NAME) + ": .*" + message):
        quantize_mxfp4(weight, name=NAME, **kwargs)
