"""The MXFP4 grouped-matmul Triton kernel (kimi_hf_kernels.mxfp4) under TRITON_INTERPRET=1 on CPU, through
kimi_hf.ops.mxfp4_grouped_linear(backend="triton"), against dequantise-then-matmul with the tests' own MXFP4 decoder
(tests/models/kimi_k3/release_format.py, written independently of kimi_hf), forward and input gradient, and
against the op's torch path. fp32 and fp16 only: the interpreter's bf16 dot is broken."""

import os

import pytest
import torch

from kimi_hf.ops.mxfp4_matmul import mxfp4_grouped_linear

from ...models.kimi_k3.release_format import dequantize_mxfp4 as reference_dequantize


pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def random_experts(E: int, out: int, n_in: int, seed: int):
    """Random MXFP4 bytes: every code, scale bytes 112 .. 135 (weights of 2^-16 .. 2^10, fp16-safe)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, out, n_in // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(112, 122, (E, out, n_in // 32), generator=g, dtype=torch.uint8)
    return packed, scale


def reference(x: torch.Tensor, packed, scale, counts, transpose=False) -> torch.Tensor:
    """fp64 per expert: x @ W_e^T (or x @ W_e)."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        w = torch.stack([reference_dequantize(packed[e], scale[e])]).double()[0]
        seg = x[start : start + n].double()
        outs.append(seg @ w if transpose else seg @ w.T)
        start += n
    return torch.cat(outs)


# counts with empty experts, one row, and more rows than a tile (BM 16 / 32 / 64 by the largest count)
@pytest.mark.parametrize(
    "counts,out,n_in", [([3, 0, 17], 48, 64), ([1], 32, 96), ([0, 40, 5, 0], 40, 32), ([70, 2], 24, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_and_input_gradient_match_dequantised_matmul(counts, out, n_in, dtype):
    packed, scale = random_experts(len(counts), out, n_in, seed=sum(counts) + out)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(sum(counts), n_in, generator=g) * 2.0**-6).to(dtype).requires_grad_(True)
    y = mxfp4_grouped_linear(x, packed, scale, counts, backend="triton")
    dy = (torch.randn(sum(counts), out, generator=g) * 2.0**-6).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    ref_y = reference(x.detach(), packed, scale, counts)
    ref_dx = reference(dy, packed, scale, counts, transpose=True)
    # fp32: products of exact weights summed in fp32 (IEEE dot), vs fp64; fp16: the output's rounding (2^-11 rel)
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    for got, ref in ((y, ref_y), (dx, ref_dx)):
        scale_ = ref.abs().max().item()
        assert (got.double() - ref).abs().max().item() <= tol * scale_, (got.double() - ref).abs().max()
    # the op's torch path (dequantise, then F.linear) agrees to the same level
    x_t = x.detach().clone().requires_grad_(True)
    y_t = mxfp4_grouped_linear(x_t, packed, scale, counts, backend="torch")
    (dx_t,) = torch.autograd.grad(y_t, x_t, dy)
    assert torch.allclose(y.float(), y_t.float(), rtol=tol, atol=tol * ref_y.abs().max().item())
    assert torch.allclose(dx.float(), dx_t.float(), rtol=tol, atol=tol * ref_dx.abs().max().item())


def test_special_values_decode_like_the_spec():
    """Codes 0 / 8 (+-0), the largest code 7 / 15 (+-6) and the NaN scale 255 through the kernel: a one-hot x picks
    single weights out."""
    packed = torch.tensor([[[0x80, 0xF7] + [0x11] * 14]], dtype=torch.uint8)  # [1 expert, 1 row, 32 inputs]
    scale = torch.tensor([[[127]]], dtype=torch.uint8)
    eye = torch.eye(32)
    y = mxfp4_grouped_linear(eye, packed, scale, [32], backend="triton")[:, 0]
    assert y[:4].tolist() == [0.0, 0.0, 6.0, -6.0]  # -0.0 (code 8) sums to +0 in a dot
    assert y[4:].tolist() == [0.5] * 28
    y_nan = mxfp4_grouped_linear(eye, packed, torch.full_like(scale, 255), [32], backend="triton")
    assert torch.isnan(y_nan).all()


def test_no_rows():
    packed, scale = random_experts(2, 32, 32, seed=0)
    y = mxfp4_grouped_linear(torch.zeros(0, 32), packed, scale, [0, 0], backend="triton")
    assert y.shape == (0, 32)
