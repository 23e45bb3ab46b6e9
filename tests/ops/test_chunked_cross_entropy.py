"""The chunked language-model head + cross-entropy (kimi_hf.ops.chunked_cross_entropy, issue 38 section 4) against
a reference written here: plain torch log_softmax in fp64. fp32 inputs; measured errors against fp64 are below 4e-7
(relative, loss and both gradients, logits of realistic size), the tests allow 1e-6. Also: transformers'
ForCausalLMLoss semantics (shift, shift_labels, ignore_index, num_items_in_batch), the module path for heads that are
not a plain nn.Linear, the bound on the logits (no [N, V] tensor is ever made), bad input, the meta device (memory
plans trace it). The model option (`loss_chunk_size`) is tested in tests/models/kimi_k3/test_chunked_loss_k3.py; the
vocabulary-parallel path on 2 gloo ranks in test_chunked_cross_entropy_tp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from kimi_hf.ops import chunked_causal_lm_loss, linear_cross_entropy
from kimi_hf.ops.chunked_cross_entropy import module_cross_entropy


IGNORE = -100
RTOL = 1e-6  # fp32 against fp64: relative to the reference's largest magnitude


def reference(hidden, weight, targets, ignore_index=IGNORE, bias=None):
    """(summed loss, count, d hidden, d weight) in fp64: log_softmax of the whole logits."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logits = h @ w.T + (0 if bias is None else bias.detach().double())
    keep = targets != ignore_index
    logp = torch.log_softmax(logits, dim=-1)[keep]
    total = -logp.gather(1, targets[keep][:, None]).sum()
    dh, dw = torch.autograd.grad(total, (h, w))
    return total.detach(), int(keep.sum()), dh, dw


def close(actual, expected, rtol=RTOL):
    err = ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()
    assert err <= rtol, err


def inputs(n=37, d=24, v=53, ignored=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(v, d, generator=g)).requires_grad_()  # logits of a few units, as a trained head's
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::ignored] = IGNORE
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 4, 37, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_loss_and_gradients_match_fp64_log_softmax(chunk_size, reduction):
    hidden, weight, targets = inputs()
    total, count, dh, dw = reference(hidden, weight, targets)
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=chunk_size, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    scale = 1 / count if reduction == "mean" else 1.0
    close(loss, total * scale)
    loss.backward()
    close(hidden.grad, dh * scale)
    close(weight.grad, dw * scale)


def test_bf16_matches_the_plain_loss_in_bf16():
    """bf16 head: the logits rounded as the plain path rounds them (matmul in bf16, then fp32)."""
    hidden, weight, targets = inputs(n=64, d=32, v=101)
    h, w = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    plain = F.cross_entropy(F.linear(h, w).float(), targets, ignore_index=IGNORE)
    ph, pw = torch.autograd.grad(plain, (h, w))
    hc, wc = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = linear_cross_entropy(hc, wc, targets, chunk_size=8)
    loss.backward()
    assert hc.grad.dtype == wc.grad.dtype == torch.bfloat16
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)  # the same bf16 logits, the same fp32 sums
    torch.testing.assert_close(hc.grad, ph, rtol=2e-2, atol=1e-4)  # one bf16 rounding of the gradients
    torch.testing.assert_close(wc.grad, pw, rtol=2e-2, atol=1e-4)


def test_autocast_rounds_as_the_plain_head_under_autocast():
    """fp32 weights under bf16 autocast: the matmuls in bf16 (forward and recomputed), the gradients in fp32."""
    hidden, weight, targets = inputs(n=64, d=32, v=101)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=IGNORE)
    ph, pw = torch.autograd.grad(plain, (hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert dh.dtype == dw.dtype == torch.float32
    assert loss.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(dh, ph, rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(dw, pw, rtol=2e-2, atol=1e-4)


def test_causal_lm_semantics_match_transformers():
    """chunked_causal_lm_loss(hidden, head, labels, ...) == ForCausalLMLoss(head(hidden), labels, ...): labels
    shifted inside, pre-shifted shift_labels, num_items_in_batch (tensor or int), another ignore_index."""
    g = torch.Generator().manual_seed(1)
    B, T, d, V = 2, 9, 16, 41
    head = nn.Linear(d, V, bias=False)
    hidden = torch.randn(B, T, d, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = IGNORE
    shifted = torch.randint(0, V, (B, T), generator=g)
    shifted[1, -2:] = IGNORE
    cases = [
        dict(labels=labels),
        dict(labels=None, shift_labels=shifted),
        dict(labels=labels, shift_labels=shifted),  # shift_labels win, as in transformers
        dict(labels=labels, num_items_in_batch=torch.tensor(7)),
        dict(labels=labels, num_items_in_batch=11),
        dict(labels=torch.where(labels == IGNORE, 0, labels), ignore_index=0),
    ]
    for case in cases:
        h = hidden.clone().requires_grad_()
        expected = ForCausalLMLoss(head(h), vocab_size=V, **case)
        eh, ew = torch.autograd.grad(expected, (h, head.weight))
        h2 = hidden.clone().requires_grad_()
        loss = chunked_causal_lm_loss(h2, head, chunk_size=5, **case)
        lh, lw = torch.autograd.grad(loss, (h2, head.weight))
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6), case
        torch.testing.assert_close(lh, eh, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(lw, ew, rtol=1e-5, atol=1e-7)


def test_no_counted_token_gives_what_the_plain_loss_gives():
    head = nn.Linear(8, 11, bias=False)
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    labels = torch.full((1, 4), IGNORE)
    assert torch.isnan(chunked_causal_lm_loss(hidden, head, labels, chunk_size=2))  # mean of nothing, as F does
    loss = chunked_causal_lm_loss(hidden, head, labels, chunk_size=2, num_items_in_batch=3)
    assert loss.item() == 0.0
    loss.backward()
    assert hidden.grad.abs().max() == 0 and head.weight.grad.abs().max() == 0


class Wrapped(nn.Module):
    """A head that is not a plain nn.Linear (as PEFT's wrappers are): its own forward must run."""

    def __init__(self, d, v):
        super().__init__()
        self.inner = nn.Linear(d, v, bias=True)

    def forward(self, x):
        return self.inner(x)


def test_any_other_head_runs_through_its_module():
    hidden, weight, targets = inputs(n=30, d=12, v=29)
    head = Wrapped(12, 29)
    with torch.no_grad():
        head.inner.weight.copy_(weight)
    total, count, dh, dw = reference(hidden, weight, targets, bias=head.inner.bias)
    loss = module_cross_entropy(hidden, head, targets, chunk_size=7)
    close(loss, total)
    loss.backward()
    close(hidden.grad, dh)
    close(head.inner.weight.grad, dw)
    # through the causal-LM wrapper: the module path is chosen for it (and for nn.Linear with a bias)
    h3 = hidden.detach()[None].requires_grad_()
    labels = torch.cat([torch.tensor([IGNORE]), targets[:-1]])[None]  # shifted inside: position i predicts i + 1
    expected = ForCausalLMLoss(head(h3), labels, vocab_size=29)
    assert chunked_causal_lm_loss(h3, head, labels, chunk_size=4).item() == pytest.approx(expected.item(), rel=1e-6)


class LargestOutput(TorchDispatchMode):
    """The most elements any op produced (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("path", ["linear", "module"])
def test_the_logits_never_exist_whole(path):
    """No op, forward or backward, makes a tensor larger than a chunk's logits; the plain loss makes [N, V]."""
    n, d, v, chunk = 256, 16, 500, 32
    hidden, weight, targets = inputs(n=n, d=d, v=v)
    head = nn.Linear(d, v, bias=False)
    with LargestOutput() as plain:
        F.cross_entropy(head(hidden).float(), targets, ignore_index=IGNORE).backward()
    assert plain.largest >= n * v
    with LargestOutput() as chunked:
        if path == "linear":
            loss = linear_cross_entropy(hidden, head.weight, targets, chunk_size=chunk)
        else:
            loss = module_cross_entropy(hidden, head, targets, chunk_size=chunk)
        loss.backward()
    assert chunked.largest <= chunk * v, (chunked.largest, chunk * v)


def test_the_meta_device_traces_forward_and_backward():
    """Memory plans trace the model on meta tensors (kimi_hf/plan/trace.py): no value is read."""
    hidden = torch.empty(64, 16, device="meta", requires_grad=True)
    weight = torch.empty(100, 16, device="meta", requires_grad=True)
    targets = torch.empty(64, dtype=torch.long, device="meta")
    loss = linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


def test_frozen_head_takes_no_gradient():
    hidden, weight, targets = inputs()
    weight.requires_grad_(False)
    linear_cross_entropy(hidden, weight, targets, chunk_size=5).backward()
    assert weight.grad is None and hidden.grad is not None


def test_bad_input_is_refused_by_name():
    hidden, weight, targets = inputs()
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="chunk_size"):
            linear_cross_entropy(hidden, weight, targets, chunk_size=bad)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, targets, chunk_size=4, reduction="none")
    with pytest.raises(ValueError, match="width"):
        linear_cross_entropy(hidden[:, :5], weight, targets, chunk_size=4)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(hidden, weight, targets[:-1], chunk_size=4)
    out_of_vocab = targets.clone()
    out_of_vocab[1] = weight.shape[0]
    with pytest.raises(RuntimeError, match="targets"):  # as F.cross_entropy refuses it, not a silent wrong loss
        linear_cross_entropy(hidden, weight, out_of_vocab, chunk_size=4)
    head = nn.Linear(24, 53, bias=False)
    with pytest.raises(ValueError, match="labels"):
        chunked_causal_lm_loss(hidden[None], head, None, chunk_size=4)
    with pytest.raises(ValueError, match="one label a token"):
        chunked_causal_lm_loss(hidden[None], head, None, shift_labels=targets[None, :-1], chunk_size=4)
