"""The fused recurrent KDA Triton kernel (kimi_hf_kernels.kda.recurrent) under TRITON_INTERPRET=1 on
CPU, through kimi_hf.ops.recurrent_kda(backend="triton"), against the fp32 reference.
fp32 and fp16 only: the interpreter's bf16 dot is broken under TRITON_INTERPRET."""

import os

import pytest
import torch

from kimi_hf.ops import recurrent_kda

from ...ops.kda_helpers import LOWER_BOUND, make_inputs, rel_rms, safe_gate_inputs


pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("K,V,l2", [(16, 40, False), (20, 16, True), (32, 32, True)])
def test_matches_reference(K, V, l2):
    inputs = make_inputs(2, 6, 3, K, V, seed=K + V)
    h0 = torch.randn(2, 3, K, V)
    with torch.no_grad():
        o, S = recurrent_kda(
            *inputs, initial_state=h0, output_final_state=True, use_qk_l2norm=l2, scale=0.4, backend="triton"
        )
        o_ref, S_ref = recurrent_kda(
            *inputs, initial_state=h0, output_final_state=True, use_qk_l2norm=l2, scale=0.4, backend="reference"
        )
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5


def test_varlen_without_initial_state_and_extreme_gates():
    inputs = make_inputs(1, 11, 2, 16, 16, strong_channels=4, seed=3)
    cu = torch.tensor([0, 4, 4, 11])
    with torch.no_grad():
        o, S = recurrent_kda(*inputs, cu_seqlens=cu, output_final_state=True, backend="triton")
        o_ref, S_ref = recurrent_kda(*inputs, cu_seqlens=cu, output_final_state=True, backend="reference")
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5
    assert torch.equal(S[1], torch.zeros_like(S[1]))  # the empty sequence


def test_fp16_inputs_fp32_state():
    inputs = [x.half() for x in make_inputs(1, 5, 2, 16, 16, seed=4)]
    with torch.no_grad():
        o, S = recurrent_kda(*inputs, output_final_state=True, backend="triton")
        o_ref, S_ref = recurrent_kda(*inputs, output_final_state=True, backend="reference")
    assert o.dtype == torch.float16 and S.dtype == torch.float32
    assert rel_rms(o.float(), o_ref.float()) <= 2e-3 and rel_rms(S, S_ref) <= 1e-5


def test_gradients_fall_back_to_the_torch_path():
    inputs = [x.requires_grad_() for x in make_inputs(1, 4, 1, 8, 8)]
    o, _ = recurrent_kda(*inputs, backend="triton")
    o.sum().backward()  # the kernel is forward-only: the dispatcher took the differentiable path
    assert all(x.grad is not None for x in inputs)


def test_fused_gate_and_beta_sigmoid():
    """Decode with the gate activation and sigmoid(beta) inside the kernel, as the model calls it."""
    q, k, v, f, beta = make_inputs(1, 5, 2, 16, 16, seed=6)
    f = f * -4.0  # raw forget input: positive values, strong decay
    A_log, dt_bias = torch.tensor([0.5, 2.5]), torch.randn(2 * 16)
    kw = dict(
        output_final_state=True,
        use_qk_l2norm=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True,
        initial_state=torch.randn(1, 2, 16, 16),
    )
    with torch.no_grad():
        o, S = recurrent_kda(q, k, v, f, beta, backend="triton", **kw)
        o_ref, S_ref = recurrent_kda(q, k, v, f, beta, backend="reference", **kw)
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5


@pytest.mark.parametrize("dtype,with_A_log", [(torch.float32, True), (torch.float32, False), (torch.float16, True)])
def test_safe_gate_fused(dtype, with_A_log):
    """Kimi K3's safe gate g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) inside the kernel (A_log
    optional), packed decode steps with initial states, against the PyTorch path."""
    cu = torch.tensor([0, 1, 1, 5])
    q, k, v, f, beta, A_log, dt_bias, h0 = safe_gate_inputs(5, 2, 16, 16, 3, seed=7)
    q, k, v, f, beta = (x.to(dtype) for x in (q, k, v, f, beta))
    kw = dict(
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm=True,
        use_gate_in_kernel=True,
        safe_gate=True,
        lower_bound=LOWER_BOUND,
        A_log=A_log if with_A_log else None,
        dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True,
    )
    with torch.no_grad():
        o, S = recurrent_kda(q, k, v, f, beta, backend="triton", **kw)
        o_ref, S_ref = recurrent_kda(q, k, v, f, beta, backend="torch", **kw)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_rms(o.float(), o_ref.float()) <= (2e-3 if dtype == torch.float16 else 1e-5)
    assert rel_rms(S, S_ref) <= 1e-5
    assert torch.equal(S[1], h0[1])  # the empty sequence
