"""The depth-attention op (hand-written backward) against the formula in fp64 autograd."""

import pytest
import torch

from kimi_hf.ops import depth_attention, depth_attention_weights


def reference(w, blocks, partial, eps):
    vs = torch.stack(list(blocks.double().unbind(0)) + ([partial.double()] if partial is not None else []))
    logits = (vs * torch.rsqrt(vs.square().mean(-1, keepdim=True) + eps)) @ w.double()
    return (logits.softmax(0)[..., None] * vs).sum(0), logits.softmax(0)


@pytest.mark.parametrize("n,with_partial", [(1, False), (1, True), (3, True), (4, False)])
def test_forward_and_gradients_match_fp64_autograd(n, with_partial):
    torch.manual_seed(n)
    B, T, d, eps = 2, 7, 24, 1e-6
    # sources of very different scales: the normalised keys must make the logits scale-free
    blocks = (torch.randn(n, B, T, d) * torch.logspace(-2, 2, n)[:, None, None, None]).requires_grad_()
    partial = torch.randn(B, T, d).mul(5).requires_grad_() if with_partial else None
    w = torch.randn(d).requires_grad_()
    upstream = torch.randn(B, T, d)
    inputs = [w, blocks] + ([partial] if with_partial else [])

    out = depth_attention(w, blocks, partial, eps)
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    ref, ref_alpha = reference(w, blocks, partial, eps)
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), inputs)

    assert out.dtype == torch.float32 and out.shape == (B, T, d)
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= 1e-5 * scale
    for g, r in zip(grads, ref_grads):
        assert (g.double() - r).abs().max().item() <= 1e-4 * r.abs().max().item()
    alpha = depth_attention_weights(w.detach(), blocks.detach(), None if partial is None else partial.detach(), eps)
    assert torch.allclose(alpha.double(), ref_alpha, atol=1e-6)


def test_bf16_sources_keep_dtype_and_compute_in_fp32():
    torch.manual_seed(0)
    blocks = torch.randn(3, 2, 5, 16).bfloat16().requires_grad_()
    partial = torch.randn(2, 5, 16).bfloat16().requires_grad_()
    w = torch.randn(16, requires_grad=True)
    out = depth_attention(w, blocks, partial)
    out.float().sum().backward()
    assert out.dtype == blocks.grad.dtype == partial.grad.dtype == torch.bfloat16
    assert w.grad.dtype == torch.float32
    ref, _ = reference(w, blocks.float(), partial.float(), 1e-6)
    assert (out.double() - ref).abs().max() < 0.05


def test_zero_query_is_the_mean_of_the_sources():
    blocks, partial = torch.randn(3, 1, 4, 8), torch.randn(1, 4, 8)
    out = depth_attention(torch.zeros(8), blocks, partial)
    assert torch.allclose(out, torch.cat([blocks, partial[None]]).mean(0), atol=1e-6)


def test_bad_shapes_name_the_argument():
    blocks = torch.randn(2, 1, 3, 8)
    with pytest.raises(ValueError, match="partial"):
        depth_attention(torch.zeros(8), blocks, torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="w must"):
        depth_attention(torch.zeros(4), blocks)
    with pytest.raises(ValueError, match="blocks"):
        depth_attention(torch.zeros(8), torch.randn(0, 1, 3, 8))


@pytest.mark.parametrize("T", [1, 3, 1024])  # decode steps and short prompts take the stacked path; long ones loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_without_autograd_matches_fp64_on_both_paths(T, dtype):
    from kimi_hf.ops.depth_attention import SMALL_SOURCE_NUMEL

    torch.manual_seed(T)
    B, d, n, eps = 2, 64, 3, 1e-6
    blocks = (torch.randn(n, B, T, d) * torch.logspace(-1, 1, n)[:, None, None, None]).to(dtype)
    partial, w = torch.randn(B, T, d).to(dtype), torch.randn(d)
    stacked = B * T * d <= SMALL_SOURCE_NUMEL
    assert stacked == (T < 1024)
    ref, _ = reference(w, blocks.float(), partial.float(), eps)
    with torch.no_grad():
        out = depth_attention(w, blocks, partial, eps)
        first = depth_attention(w, blocks, None, eps)  # no partial sum yet (before the first sublayer)
    with torch.enable_grad():  # the autograd path on the same values
        looped = depth_attention(w.requires_grad_(), blocks, partial, eps).detach()
    assert out.dtype == dtype and out.shape == (B, T, d)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.double() - ref).abs().max().item() <= tol * ref.abs().max().item()
    assert (out.float() - looped.float()).abs().max().item() <= tol * ref.abs().max().item()
    ref_first, _ = reference(w.detach(), blocks.float(), None, eps)
    assert (first.double() - ref_first).abs().max().item() <= tol * ref_first.abs().max().item()
