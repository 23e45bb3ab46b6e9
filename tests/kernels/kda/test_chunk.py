"""The chunked KDA Triton kernels (kimi_hf_kernels.kda.chunk) under TRITON_INTERPRET=1 on CPU, through
kimi_hf.ops.chunk_kda(backend="triton"), forward and backward, against the fp32 token-loop reference.

Tolerances: relative RMS error <= 1e-4 in fp32 for the output, the final state and every gradient
(fla's tests use ~5e-3 in bf16 on GPU; fp32 under the interpreter has no tf32 rounding). fp16 inputs:
2e-3 on the output, 1e-2 on gradients. bf16 is not tested here: the interpreter's bf16 dot is
broken (bf16 tl.dot under TRITON_INTERPRET). Shapes are small: the interpreter runs every program in Python.
"""

import os

import pytest
import torch

from kimi_hf.ops import chunk_kda

from ...ops.kda_helpers import LOWER_BOUND, make_inputs, rel_rms, run_with_grads, safe_gate_inputs


pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def _compare(inputs, h0, tol_o=1e-4, tol_grad=1e-4, **kw):
    o, S, grads = run_with_grads(chunk_kda, inputs, h0, backend="triton", **kw)
    o_ref, S_ref, grads_ref = run_with_grads(chunk_kda, [x.float() for x in inputs], h0, backend="reference", **kw)
    assert o.dtype == inputs[0].dtype and S.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o.float(), o_ref) <= tol_o and rel_rms(S, S_ref) <= tol_o
    names = ["q", "k", "v", "g", "beta", "h0"]
    for name, gr, gr_ref in zip(names, grads, grads_ref):
        assert gr.dtype == (torch.float32 if name == "h0" else inputs[0].dtype), name
        assert torch.isfinite(gr).all(), name
        assert rel_rms(gr.float(), gr_ref) <= tol_grad, (name, rel_rms(gr.float(), gr_ref))
    return o, S


@pytest.mark.parametrize(
    "B,T,H,K,V,with_h0",
    [
        (1, 70, 2, 16, 40, True),  # a tail chunk of 6 tokens; V spans two value blocks
        (2, 20, 1, 20, 16, False),  # shorter than a chunk; K not a power of two; two sequences
    ],
)
def test_matches_reference_with_gradients(B, T, H, K, V, with_h0):
    inputs = make_inputs(B, T, H, K, V, seed=T + K)
    _compare(inputs, torch.randn(B, H, K, V) if with_h0 else None)


def test_packed_sequences_with_an_empty_one_and_extreme_gates():
    """Varlen boundaries (one sequence spans two chunks and ends mid-chunk, one is empty) with
    e^-30 per-step decay on some channels: no leakage across sequences, exact final states."""
    inputs = make_inputs(1, 75, 1, 16, 16, seed=5, strong_channels=4)
    cu = torch.tensor([0, 5, 5, 75])
    h0 = torch.randn(3, 1, 16, 16)
    _, S = _compare(inputs, h0, cu_seqlens=cu)
    assert torch.equal(S[1], h0[1])  # the empty sequence leaves its state untouched


def test_fused_gate_beta_sigmoid_and_l2norm():
    """g = -exp(A_log) softplus(f + dt_bias), sigmoid(beta) and the q/k L2 norm inside the kernels,
    against the same formulas applied in fp32 torch before the reference; gates reach -80 per step."""
    B, T, H, K, V = 1, 40, 2, 16, 16
    gen = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(B, T, H, K, generator=gen),
        torch.randn(B, T, H, K, generator=gen),
        torch.randn(B, T, H, V, generator=gen),
    )
    f = torch.randn(B, T, H, K, generator=gen) * 2
    f[..., :2] = 5.0  # with A_log = log 16: g ~ -80 per step on these channels
    beta = torch.randn(B, T, H, generator=gen)
    A_log = torch.tensor([0.0, 16.0]).log().clamp_min(0.0).requires_grad_()
    dt_bias = (torch.randn(H * K, generator=gen) * 0.5).requires_grad_()

    def run(backend):
        xs = [x.clone().requires_grad_() for x in (q, k, v, f, beta)]
        params = [A_log.detach().clone().requires_grad_(), dt_bias.detach().clone().requires_grad_()]
        o, S = chunk_kda(
            *xs,
            output_final_state=True,
            use_qk_l2norm=True,
            use_gate_in_kernel=True,
            A_log=params[0],
            dt_bias=params[1],
            use_beta_sigmoid_in_kernel=True,
            backend=backend,
        )
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
        ((o * w).sum() + S.sum()).backward()  # S.sum(): autograd hands over a stride-0 dS
        return o, S, [x.grad for x in xs + params]

    o, S, grads = run("triton")
    o_ref, S_ref, grads_ref = run("reference")
    assert rel_rms(o, o_ref) <= 1e-4 and rel_rms(S, S_ref) <= 1e-4
    for name, gr, gr_ref in zip(["q", "k", "v", "f", "beta", "A_log", "dt_bias"], grads, grads_ref):
        assert torch.isfinite(gr).all() and rel_rms(gr, gr_ref) <= 1e-4, (name, rel_rms(gr, gr_ref))


def test_fp16_inputs_keep_fp32_state():
    inputs = [x.half() for x in make_inputs(1, 40, 1, 16, 16, seed=2)]
    _compare(inputs, torch.randn(1, 1, 16, 16), tol_o=2e-3, tol_grad=1e-2)


@pytest.mark.parametrize(
    "dtype,with_A_log,packed,tol_o,tol_grad",
    [(torch.float32, True, True, 1e-4, 1e-4), (torch.float16, False, False, 2e-3, 1e-2)],
)
def test_safe_gate_fused_forward_and_backward(dtype, with_A_log, packed, tol_o, tol_grad):
    """Kimi K3's safe gate g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) fused into the kernels
    (forward and backward, A_log optional), with sigmoid(beta) and the L2 norm and initial states, some
    channels saturating at g = lower_bound and g = 0: against the PyTorch path on the same inputs, the
    gradients of A_log and dt_bias included. Packed: two chunks (A_log's gradient is summed over chunks)
    and an empty sequence. (Chunk boundaries inside a sequence do not involve the gate: the tests above
    cover them.)"""
    cu = torch.tensor([0, 24, 24, 40]) if packed else None
    q, k, v, f, beta, A_log, dt_bias, h0 = safe_gate_inputs(40, 2, 16, 16, 3 if packed else 1, seed=13)
    q, k, v, f, beta = (x.to(dtype) for x in (q, k, v, f, beta))
    params = [dt_bias] + ([A_log] if with_A_log else [])

    def run(backend):
        xs = [x.clone().requires_grad_() for x in (q, k, v, f, beta, h0, *params)]
        o, S = chunk_kda(
            *xs[:5],
            initial_state=xs[5],
            output_final_state=True,
            cu_seqlens=cu,
            use_qk_l2norm=True,
            use_gate_in_kernel=True,
            safe_gate=True,
            lower_bound=LOWER_BOUND,
            dt_bias=xs[6],
            A_log=xs[7] if with_A_log else None,
            use_beta_sigmoid_in_kernel=True,
            backend=backend,
        )
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1))
        ((o.float() * w).sum() + S.sum()).backward()  # S.sum(): autograd hands over a stride-0 dS
        return o, S, [x.grad for x in xs]

    o, S, grads = run("triton")
    o_ref, S_ref, grads_ref = run("torch")
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_rms(o.float(), o_ref.float()) <= tol_o and rel_rms(S, S_ref) <= tol_o
    if packed:
        assert torch.equal(S[1], h0[1])  # the empty sequence
    for name, gr, gr_ref in zip(["q", "k", "v", "f", "beta", "h0", "dt_bias", "A_log"], grads, grads_ref):
        assert gr.dtype == gr_ref.dtype and torch.isfinite(gr).all(), name
        assert rel_rms(gr.float(), gr_ref.float()) <= tol_grad, (name, rel_rms(gr.float(), gr_ref.float()))
