"""MXFP4 codec for Kimi K3's routed experts (compressed-tensors' `mxfp4-pack-quantized` format, the
OCP Microscaling (MX) Formats Specification v1.0's MXFP4: E2M1 elements, one E8M0 scale per 32).

For a logical weight W [out, in] (in a multiple of 32) the checkpoint holds

- `weight_packed` [out, in / 2] uint8: byte j of a row holds element 2j in the LOW nibble and element 2j + 1
  in the high nibble (`byte = code[2j] | code[2j + 1] << 4`);
- `weight_scale` [out, in / 32] uint8: an E8M0 exponent s, scale 2^(s - 127), one per 32 consecutive
  elements of a row (s = 255 is the spec's NaN);

and W[r, c] = E2M1(code(r, c)) * 2^(s[r, c // 32] - 127), with E2M1(n) = (-1)^((n >> 3) & 1) * LUT[n & 7],
LUT = [0, 0.5, 1, 1.5, 2, 3, 4, 6]. Every such value has at most 2 significant bits and a magnitude in
[2^-128, 1.5 * 2^129]: bfloat16 and float32 hold all below 2^128 exactly (2^-128 as a subnormal), i.e. all
but large codes at the two largest scale bytes (253, 254), which no real weight uses and which become inf;
float64 holds everything. Dequantising is lossless.

`dequantize_mxfp4` decodes (any leading dims, e.g. experts [E, out, in / 2]); `quantize_mxfp4` re-packs,
exactly for MXFP4-representable weights (`exact=True`, the default, refuses anything else) or, with
`exact=False`, by the MX spec's rounding (so a fine-tuned bf16 model can be exported back to MXFP4).

Part of the flat, Hub-copyable model folder: torch only.
"""

from __future__ import annotations

import functools
import math

import torch

from ..mx_block import MX_BLOCK


GROUP = MX_BLOCK  # elements per E8M0 scale (kimi_hf.mx_block)
E8M0_BIAS = 127
E8M0_NAN = 255
# E2M1 by code: bit 3 the sign, bits 0-2 the magnitude (bit 0 the mantissa bit, bits 1-2 the exponent)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)  # 16 codes; code 8 is -0.0
E2M1_EMAX = 2  # exponent of E2M1's largest normal (6 = 1.5 * 2^2): the MX shared-exponent offset
# the compressed-tensors writer's scale byte for an all-zero group: its generate_mxfp4_scales computes
# 127 + floor(log2(amax)) - 2 and clamps to [0, 255]; log2(0) = -inf clamps to 0
ZERO_GROUP_SCALE = 0
# rows per block so that a block's temporaries stay near 2^22 elements
_BLOCK_ELEMENTS = 1 << 22
# (exponent bits, mantissa bits, the signed integer dtype of the same width) of the dtypes decoded by bits
_FORMATS = {
    torch.bfloat16: (8, 7, torch.int16),
    torch.float32: (8, 23, torch.int32),
    torch.float64: (11, 52, torch.int64),
}


def _value_bits(code: int, s: int, exp_bits: int, man_bits: int) -> int:
    """The IEEE bit pattern of E2M1(code) * 2^(s - 127) in a binary format with exp_bits / man_bits,
    by integer arithmetic alone (so exact, subnormals included, whatever the process's flush-to-zero
    mode). s = 255 gives a quiet NaN; values beyond the format's range give inf."""
    sign = (code >> 3) << (exp_bits + man_bits)
    inf = ((1 << exp_bits) - 1) << man_bits
    if s == E8M0_NAN:
        return inf | (1 << (man_bits - 1))
    magnitude = code & 7
    if magnitude == 0:
        return sign
    # E2M1 magnitudes 0.5 .. 6 as (1 + half / 2) * 2^e: 0.5 = 1 * 2^-1, 1, 1.5, 2, 3, 4, 6 = 1.5 * 2^2
    e = (magnitude >> 1) - 1 + (s - E8M0_BIAS) if magnitude > 1 else s - E8M0_BIAS - 1
    half = magnitude & 1 if magnitude > 1 else 0
    bias = (1 << (exp_bits - 1)) - 1
    if e + bias >= (1 << exp_bits) - 1:
        return sign | inf
    if e + bias >= 1:
        return sign | (e + bias) << man_bits | half << (man_bits - 1)
    # subnormal: (2 + half) * 2^(e - 1) in units of the smallest subnormal 2^(1 - bias - man_bits)
    shift = e + bias + man_bits - 2
    return sign | ((2 + half) << shift if shift >= 0 else 0)


@functools.lru_cache(maxsize=16)
def _pair_table(dtype: torch.dtype, device: str) -> torch.Tensor:
    """[256 * 256, 2] of `dtype` (bf16 / fp32 / fp64): row s * 256 + b holds the two elements of packed
    byte b under scale byte s, (element 2j from the low nibble, element 2j + 1 from the high one). Built
    from the 16 E2M1 codes as bit patterns, so one gather per byte decodes both elements exactly."""
    exp_bits, man_bits, int_dtype = _FORMATS[dtype]
    width = 1 + exp_bits + man_bits
    codes = [[_value_bits(c, s, exp_bits, man_bits) for c in range(16)] for s in range(256)]
    signed = [[b - (1 << width) if b >> (width - 1) else b for b in row] for row in codes]
    table = torch.tensor(signed, dtype=int_dtype, device=device)  # [256 scales, 16 codes]
    byte = torch.arange(256, device=device)
    pairs = torch.stack([table[:, byte & 15], table[:, byte >> 4]], dim=-1)  # [256, 256, 2]
    return pairs.reshape(256 * 256, 2).view(dtype)


def _check_packed(packed, scale, name, expected_shape) -> tuple[int, int]:
    """ValueError naming `name` unless packed [..., out, in / 2] / scale [..., out, in / 32] are uint8
    MXFP4 tensors of one logical [..., out, in] weight (= expected_shape's (out, in) when given).
    Returns (out, in)."""
    for what, t in (("weight_packed", packed), ("weight_scale", scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise ValueError(f"{name}: {what} must be uint8, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name}: {what} must be [..., out, width], got shape {tuple(t.shape)}")
    if packed.dim() != scale.dim():
        raise ValueError(
            f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} differ in rank"
        )
    if packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(
            f"{name}: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scale.shape)} differ before "
            "the last dim (they must share [..., out])"
        )
    out, width = packed.shape[-2], packed.shape[-1]
    if width % (GROUP // 2):
        parity = "odd" if width % 2 else "not a multiple of 16"
        raise ValueError(
            f"{name}: weight_packed width {width} is {parity}: it holds in = 2 * {width} = {2 * width} "
            f"elements a row, which must be a multiple of {GROUP}"
        )
    n_in = 2 * width
    if scale.shape[-1] != n_in // GROUP:
        raise ValueError(
            f"{name}: weight_scale width {scale.shape[-1]} must be in / {GROUP} = {n_in // GROUP} "
            f"(weight_packed width {width} * 2 / {GROUP})"
        )
    if expected_shape is not None:
        e_out, e_in = (int(d) for d in expected_shape)
        if e_in % GROUP:
            raise ValueError(f"{name}: expected in = {e_in} is not a multiple of {GROUP}")
        if (out, n_in) != (e_out, e_in):
            raise ValueError(
                f"{name}: weight_packed {tuple(packed.shape)} / weight_scale {tuple(scale.shape)} hold a "
                f"[{out}, {n_in}] weight, expected [{e_out}, {e_in}] (packed [{e_out}, {e_in // 2}], "
                f"scale [{e_out}, {e_in // GROUP}])"
            )
    return out, n_in


def check_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, name: str = "weight", expected_shape: tuple[int, int] | None = None
) -> tuple[int, int]:
    """The checks of a checkpoint's MXFP4 tensor before it is used: uint8 packed [..., out, in / 2] and scale
    [..., out, in / 32] of one [out, in] weight (= expected_shape when given), and no scale byte 255 (the MX spec's
    NaN, which no trained weight has: a corrupt or mis-read file). A ValueError names `name` and the first bad
    scale's position. Returns (out, in)."""
    shape = _check_packed(packed, scale, name, expected_shape)
    nan = scale == E8M0_NAN
    if nan.any():
        where = nan.nonzero()[0].tolist()
        raise ValueError(
            f"{name}: weight_scale holds the E8M0 NaN byte {E8M0_NAN} at {tuple(where)} (row {where[-2]}, inputs "
            f"{where[-1] * GROUP} .. {where[-1] * GROUP + GROUP - 1}): not a valid MXFP4 scale"
        )
    return shape


def dequantize_mxfp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "weight",
    expected_shape: tuple[int, int] | None = None,
) -> torch.Tensor:
    """MXFP4 -> a dense weight, exactly.

    packed: [..., out, in / 2] uint8 (element 2j in the low nibble of byte j, 2j + 1 in the high one);
    scale: [..., out, in / 32] uint8 E8M0 exponents (2^(s - 127); 255 decodes its 32 elements to NaN);
    leading dims (experts, ...) are shared. Returns [..., out, in] of `dtype` on packed's device.

    Exact for bfloat16 / float32 / float64: each byte indexes a table of (scale byte, byte) -> its two
    elements, built from the 16 E2M1 codes and the exponent by integer arithmetic into the output
    dtype's bit patterns, so no float operation (and no flush-to-zero mode) touches a value; only
    magnitudes >= 2^128 (large codes at scale bytes 253 / 254) are inf in bf16 / fp32. Other dtypes
    (float16 cannot hold the scales) are decoded in fp32, then cast. Decodes in row blocks of about
    2^22 elements straight into the output: the only temporary is an int32 index per byte of a block
    (a [3072, 3584] expert matrix is 3 blocks); the table (512 KiB in fp32) is cached per device.

    `name` names the tensor in the ValueErrors for malformed inputs (dtype not uint8, ranks or leading
    dims that differ, a packed width that is odd or not a multiple of 16, a scale width other than
    packed width * 2 / 32); with `expected_shape=(out, in)` the logical shape must also match.
    """
    out, n_in = _check_packed(packed, scale, name, expected_shape)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name}: dtype must be a floating torch.dtype, got {dtype}")
    lead = packed.shape[:-2]
    width, groups = n_in // 2, n_in // GROUP
    rows = packed.reshape(-1, width)
    scales = scale.reshape(-1, groups)
    result = torch.empty(*lead, out, n_in, dtype=dtype, device=packed.device)
    flat = result.view(-1, n_in)
    # bf16 / fp32 / fp64 are decoded by a table gather, no arithmetic: exact, subnormals included, even
    # with flush-to-zero on. Other dtypes (float16 cannot hold the scales) go through fp32 and a cast.
    direct = dtype in _FORMATS
    pairs = _pair_table(dtype if direct else torch.float32, str(packed.device))
    # a byte's two bf16 / fp32 elements gathered as one int32 / int64: a 1-D gather of a machine word is
    # several times faster than one of 2-element rows (bit views: nothing is converted)
    wide = {torch.bfloat16: torch.int32, torch.float32: torch.int64}.get(pairs.dtype)
    words = pairs.view(wide).view(-1) if wide is not None else None
    step = max(1, _BLOCK_ELEMENTS // max(n_in, 1))
    for r0 in range(0, rows.shape[0], step):
        block = rows[r0 : r0 + step]
        b = block.shape[0]
        # the table row of each byte, its scale byte * 256 + the byte: one broadcast add (uint8 + int32
        # promotes to int32, which index_select takes at half the memory of int64)
        index = block.reshape(b, groups, GROUP // 2) + (scales[r0 : r0 + b].to(torch.int32) << 8)[..., None]
        if direct and wide is not None:
            torch.index_select(words, 0, index.view(-1), out=flat[r0 : r0 + b].view(wide).view(-1))
        elif direct:  # fp64: 2-element rows
            torch.index_select(pairs, 0, index.view(-1), out=flat[r0 : r0 + b].view(-1, 2))
        else:
            flat[r0 : r0 + b].copy_(words.index_select(0, index.view(-1)).view(pairs.dtype).view(b, n_in))
    return result


def _powers_of_two(lo: int, hi: int, device) -> torch.Tensor:
    """[hi - lo + 1] fp64: 2^k for k = lo .. hi, from math.ldexp (Python floats are doubles: exact)."""
    return torch.tensor([math.ldexp(1.0, k) for k in range(lo, hi + 1)], dtype=torch.float64, device=device)


# (exponent bits, mantissa bits, integer view dtype) of the inputs read bit by bit
_READ_FORMATS = {
    torch.bfloat16: (8, 7, torch.int16),
    torch.float16: (5, 10, torch.int16),
    torch.float32: (8, 23, torch.int32),
}
_READ_EXPONENTS = (-149, 120)  # 2^k of a significand bit: fp32's smallest subnormal .. bf16's largest


def _read_float64(w: torch.Tensor, powers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A floating block -> (its values in fp64, exactly, a mask of the non-finite ones). bf16 / fp16 /
    fp32 are read from their bits as significand * 2^k: subnormal inputs stay exact even where the
    process flushes denormals (a plain cast would read them as 0 under flush-to-zero). fp64 is used as
    it is; other dtypes (float8 ...) go through a cast to fp32 first."""
    if w.dtype == torch.float64:
        return w, ~torch.isfinite(w)
    if w.dtype not in _READ_FORMATS:
        w = w.to(torch.float32)
    exp_bits, man_bits, int_dtype = _READ_FORMATS[w.dtype]
    bits = w.contiguous().view(int_dtype).to(torch.int64)
    field = (bits >> man_bits) & ((1 << exp_bits) - 1)
    significand = (bits & ((1 << man_bits) - 1)) | torch.where(field > 0, 1 << man_bits, 0)
    k = field.clamp(min=1) - ((1 << (exp_bits - 1)) - 1) - man_bits
    value = significand.to(torch.float64) * powers.index_select(0, (k - _READ_EXPONENTS[0]).view(-1)).view(k.shape)
    value = torch.where(((bits >> (exp_bits + man_bits)) & 1).bool(), -value, value)
    return value, field == (1 << exp_bits) - 1


def _e2m1_thresholds(device, dtype) -> torch.Tensor:
    """[7]: the midpoints between consecutive E2M1 magnitudes, for torch.bucketize (which counts the
    thresholds strictly below a value). Round to nearest, ties to even: a tie goes to the code whose
    mantissa bit (bit 0) is 0. At 0.25, 1.25, 2.5 and 5 that is the lower neighbour (0, 1, 2, 4), so the
    midpoint itself is the threshold; at 0.75, 1.75 and 3.5 the upper one (1, 2, 4), so the threshold is
    the next smaller float, below which the tie no longer lies."""
    mid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=dtype, device=device)
    tie_up = torch.tensor([False, True, False, True, False, True, False], device=device)
    return torch.where(tie_up, torch.nextafter(mid, torch.zeros_like(mid)), mid)


def _round_e2m1(q: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """Scaled values q -> E2M1 codes (uint8): round to nearest, ties to even, magnitudes above 6 saturate to
    6 (code 7: the MX spec clamps to the largest normal). The sign bit is q's own, so -0.0 (and a
    negative value that rounds to 0) keeps code 8."""
    magnitude = torch.bucketize(q.abs(), thresholds, out_int32=True).to(torch.uint8)
    return magnitude | (torch.signbit(q).to(torch.uint8) << 3)


def quantize_mxfp4(
    weight: torch.Tensor,
    name: str = "weight",
    exact: bool = True,
    zero_scale: int = ZERO_GROUP_SCALE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight -> MXFP4 (packed, scale), the inverse of `dequantize_mxfp4`.

    weight: [..., out, in] floating (in a multiple of 32). Returns packed [..., out, in / 2] uint8 (element
    2j in the low nibble) and scale [..., out, in / 32] uint8 (E8M0 exponents), on weight's device.

    Scale per 32-group: the OCP MX v1.0 shared exponent e = floor(log2(amax)) - 2 (2: E2M1's emax),
    clamped to the E8M0 range [-127, 127], scale byte e + 127. For a group whose values are codes *
    2^e' (what `dequantize_mxfp4` produces) this is the smallest e' that represents it: amax / 2^e lies in
    [4, 8) and only 4 and 6 there are codes. So for every group whose largest magnitude has code 4 or 6
    (all that the MX rule writes, and all that compressed-tensors' writer does: it rounds amax / 2^e into
    [3.5, 7), i.e. to code 4 or 6), or whose scale byte is 0, quantize_mxfp4(dequantize_mxfp4(p, s))
    == (p, s) bit for bit.
    A group whose codes all lie in [-3, 3] (at a scale byte > 0) re-packs to the next smaller scale byte
    with doubled codes: the same values, other bytes.

    All-zero groups (+-0 only) carry no exponent: they get `zero_scale` (default 0, which the
    compressed-tensors writer produces, log2(0) = -inf clamped to the lowest byte; 127, scale 1, is the
    other common choice). Their scale byte therefore need not round trip; their values (and zero signs:
    -0.0 is code 8) do.

    exact=True (default): a weight that is not MXFP4-representable (a value off the group's grid, or
    beyond the E8M0 range) raises a ValueError naming `name`, so nothing is silently rounded.
    exact=False: each value / 2^e rounds to the nearest E2M1 value, ties to even, magnitudes above 6
    saturating to 6, as the MX spec converts (the shared-exponent rule above, so a group's amax lands in
    [4, 8) before rounding). Use it to export a fine-tuned bf16 model. Non-finite values raise in both
    modes. Works in fp64, in row blocks of about 2^22 elements; bf16 / fp16 / fp32 weights are read from
    their bits, so subnormal inputs count even under torch.set_flush_denormal(True).
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        what = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"{name}: expected a floating weight, got {what}")
    if weight.dim() < 2:
        raise ValueError(f"{name}: expected a weight [..., out, in], got shape {tuple(weight.shape)}")
    if weight.shape[-1] % GROUP:
        parity = "odd" if weight.shape[-1] % 2 else f"not a multiple of {GROUP}"
        raise ValueError(f"{name}: in = {weight.shape[-1]} is {parity}; MXFP4 packs groups of {GROUP} elements")
    if not 0 <= int(zero_scale) < E8M0_NAN:
        raise ValueError(f"{name}: zero_scale {zero_scale} is not an E8M0 scale byte (0 .. 254)")
    *lead, out, n_in = weight.shape
    groups = n_in // GROUP
    rows = weight.reshape(-1, n_in)
    packed = torch.empty(rows.shape[0], n_in // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(rows.shape[0], groups, dtype=torch.uint8, device=weight.device)
    # all in fp64, where every input value and every q = w / 2^e below is a normal number: the exact
    # check and the rounding never meet a subnormal (or a flush-to-zero mode)
    read_powers = _powers_of_two(*_READ_EXPONENTS, weight.device)
    powers = _powers_of_two(-E8M0_BIAS, E8M0_BIAS, weight.device)  # 2^(s - 127) at index s, s = 0 .. 254
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=weight.device)
    thresholds = _e2m1_thresholds(weight.device, torch.float64)
    step = max(1, _BLOCK_ELEMENTS // n_in)
    for r0 in range(0, rows.shape[0], step):
        w, non_finite = _read_float64(rows[r0 : r0 + step], read_powers)
        b = w.shape[0]
        w = w.reshape(b, groups, GROUP)
        if non_finite.any():
            bad = non_finite.nonzero()[0].tolist()
            raise ValueError(f"{name}: non-finite value at row {r0 + bad[0]}, column {bad[1]}")
        amax = w.abs().amax(-1)
        # frexp: amax = m * 2^k with m in [0.5, 1), so floor(log2(amax)) = k - 1, exactly (no log2 rounding)
        exponent = torch.frexp(amax).exponent.to(torch.int32) - 1 - E2M1_EMAX
        s = (exponent + E8M0_BIAS).clamp_(0, E8M0_NAN - 1)
        s = torch.where(amax == 0, torch.full_like(s, int(zero_scale)), s)
        # w / 2^(s - 127) as w * 2^(127 - s), an exact power of two (at index 254 - s)
        q = w * powers.index_select(0, (E8M0_NAN - 1 - s).reshape(-1)).view(b, groups, 1)
        codes = _round_e2m1(q, thresholds)
        # checked on the decoded values, code * 2^(s - 127) == w (both exact in fp64), not on q: a test
        # on q alone would be fooled where q underflows (fp64 weights of 2^-1000 next to 2^100)
        if exact:
            decoded = values.index_select(0, codes.view(-1).to(torch.int32)).view(b, groups, GROUP)
            decoded *= powers.index_select(0, s.reshape(-1)).view(b, groups, 1)
        if exact and not torch.equal(decoded, w):
            bad = (decoded != w).nonzero()[0].tolist()
            r, c = r0 + bad[0], bad[1] * GROUP + bad[2]
            raise ValueError(
                f"{name}: not MXFP4-representable (value {w[tuple(bad)].item()!r} at row {r}, column {c} is no "
                f"E2M1 code times its 32-group's scale 2^{int(s[bad[0], bad[1]]) - E8M0_BIAS}); "
                "pass exact=False to round"
            )
        codes = codes.view(b, n_in // 2, 2)
        packed[r0 : r0 + b] = codes[..., 0] | (codes[..., 1] << 4)
        scale[r0 : r0 + b] = s.to(torch.uint8)
    return packed.view(*lead, out, n_in // 2), scale.view(*lead, out, groups)


__all__ = ["GROUP", "E2M1_VALUES", "ZERO_GROUP_SCALE", "check_mxfp4", "dequantize_mxfp4", "quantize_mxfp4"]
