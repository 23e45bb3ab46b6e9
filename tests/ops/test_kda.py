"""kimi_hf.ops.chunk_kda / recurrent_kda: exactness against the fp32 token-loop reference, gradients,
extreme gates, packed sequences, low precision, dispatch and input validation.

Tolerance: relative RMS error <= 1e-4 in fp32 (outputs, final states and every gradient).
"""

import inspect
import warnings

import pytest
import torch

import kimi_hf.ops.kda as kda_mod
from kimi_hf.ops import chunk_kda, l2norm, naive_recurrent_kda, recurrent_kda

from .kda_helpers import LOWER_BOUND, TOL, make_inputs, rel_rms, run_with_grads, safe_gate_fp64, safe_gate_inputs


@pytest.mark.parametrize(
    "B,T,H,K,V,with_h0",
    [
        (2, 100, 3, 32, 48, True),  # T not a multiple of the chunk, K != V
        (2, 100, 3, 32, 48, False),
        (1, 7, 2, 16, 16, True),  # shorter than one chunk
        (1, 128, 2, 16, 8, True),  # exactly two chunks
        (3, 65, 1, 8, 24, False),  # one token into the second chunk
    ],
)
def test_chunk_matches_reference_with_gradients(B, T, H, K, V, with_h0):
    inputs = make_inputs(B, T, H, K, V, seed=T + K)
    h0 = torch.randn(B, H, K, V) if with_h0 else None
    o, S, grads = run_with_grads(chunk_kda, inputs, h0)
    o_ref, S_ref, grads_ref = run_with_grads(chunk_kda, inputs, h0, backend="reference")
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V) and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= TOL
    assert rel_rms(S, S_ref) <= TOL
    names = ["q", "k", "v", "g", "beta", "h0"]
    for name, a, b in zip(names, grads, grads_ref):
        assert rel_rms(a, b) <= TOL, name


@pytest.mark.parametrize("packed", [False, True])
def test_gradcheck_float64(packed):
    """Exact-arithmetic check of the hand-written backward (chunk 8 so that several chunks and
    all binary levels are exercised at a tiny size)."""
    cu = torch.tensor([0, 3, 9, 9, 21]) if packed else None
    B, N = (1, 4) if packed else (2, 2)
    xs = [x.requires_grad_() for x in make_inputs(B, 21, 2, 4, 3, dtype=torch.float64)]
    h0 = torch.randn(N, 2, 4, 3, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, g, beta, h):
        return kda_mod._chunk_torch(q, k, v, g, beta, 0.7, h, True, cu_seqlens=cu, chunk_size=8)

    assert torch.autograd.gradcheck(f, (*xs, h0))


def test_extreme_gates_stay_finite_and_exact():
    """Per-step g of -30 on some channels (and mild elsewhere): a factorised form with one anchor
    per chunk would overflow (e^(30 * 64)); ours must stay finite and exact."""
    inputs = make_inputs(1, 150, 2, 16, 16, gate=3.0, strong_channels=5, seed=7)
    h0 = torch.randn(1, 2, 16, 16)
    o, S, grads = run_with_grads(chunk_kda, inputs, h0)
    o_ref, S_ref, grads_ref = run_with_grads(chunk_kda, inputs, h0, backend="reference")
    for t in (o, S, *grads):
        assert torch.isfinite(t).all()
    assert rel_rms(o, o_ref) <= TOL and rel_rms(S, S_ref) <= TOL
    for a, b in zip(grads, grads_ref):
        assert rel_rms(a, b) <= TOL


def test_gates_of_minus_1000_stay_finite():
    q, k, v, g, beta = make_inputs(1, 70, 1, 8, 8)
    g = torch.full_like(g, -1000.0)
    o, S = chunk_kda(q, k, v, g, beta, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    # with the state wiped at every step, o_t = scale * (q_t . k_t) beta_t v_t
    expect = (q * k).sum(-1, keepdim=True) * 8**-0.5 * beta[..., None] * v
    assert rel_rms(o, expect) <= TOL


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_packed_sequences_equal_separate_runs(fn):
    lens = [5, 65, 0, 130, 3]
    H, K, V = 2, 16, 24
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    inputs = make_inputs(1, sum(lens), H, K, V, seed=3)
    h0 = torch.randn(len(lens), H, K, V)
    w_o, w_S = torch.randn(1, sum(lens), H, V), torch.randn(len(lens), H, K, V)
    o, S, grads = run_with_grads(fn, inputs, h0, weights=(w_o, w_S), cu_seqlens=cu)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == s:  # an empty sequence keeps its initial state
            assert torch.equal(S[n], h0[n])
            continue
        part = [x[:, s:e] for x in inputs]
        o_n, S_n, grads_n = run_with_grads(fn, part, h0[n : n + 1], weights=(w_o[:, s:e], w_S[n : n + 1]))
        assert rel_rms(o[:, s:e], o_n) <= TOL
        assert rel_rms(S[n : n + 1], S_n) <= TOL
        for a, b in zip(grads[:5], grads_n[:5]):
            assert rel_rms(a[:, s:e], b) <= TOL
        assert rel_rms(grads[5][n : n + 1], grads_n[5]) <= TOL


def test_packed_matches_reference():
    cu = torch.tensor([0, 64, 64 + 70, 200])
    inputs = make_inputs(1, 200, 3, 16, 16, seed=5)
    o, S = chunk_kda(*inputs, cu_seqlens=cu, output_final_state=True)
    o_ref, S_ref = chunk_kda(*inputs, cu_seqlens=cu, output_final_state=True, backend="reference")
    assert rel_rms(o, o_ref) <= TOL and rel_rms(S, S_ref) <= TOL


def test_decode_continues_prefill():
    """Prefill with chunk_kda, then decode token by token with recurrent_kda (state in, state out)."""
    q, k, v, g, beta = make_inputs(2, 90, 2, 16, 16, seed=11)
    o_full, S_full = chunk_kda(q, k, v, g, beta, output_final_state=True)
    o_pre, S = chunk_kda(q[:, :80], k[:, :80], v[:, :80], g[:, :80], beta[:, :80], output_final_state=True)
    outs = [o_pre]
    for t in range(80, 90):
        o_t, S = recurrent_kda(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            g[:, t : t + 1],
            beta[:, t : t + 1],
            initial_state=S,
            output_final_state=True,
        )
        outs.append(o_t)
    assert rel_rms(torch.cat(outs, 1), o_full) <= TOL
    assert rel_rms(S, S_full) <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    inputs32 = make_inputs(2, 100, 2, 32, 32, seed=2)
    inputs = [x.to(dtype) for x in inputs32]
    o, S, grads = run_with_grads(chunk_kda, inputs, None)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert all(gr.dtype == dtype for gr in grads)
    for t in (o, S, *grads):
        assert torch.isfinite(t.float()).all()
    # the same rounded inputs in fp32: everything runs in fp32 inside, so only o's rounding differs
    o32, S32 = chunk_kda(*[x.float() for x in inputs], output_final_state=True)
    assert rel_rms(o, o32) <= 1e-2
    assert rel_rms(S, S32) <= 1e-5
    # and against the unrounded fp32 inputs (bf16 keeps 8 bits of mantissa: about 0.4% here)
    assert rel_rms(o, chunk_kda(*inputs32)[0]) <= (2e-2 if dtype == torch.bfloat16 else 5e-3)


def test_l2norm_option_and_scale():
    q, k, v, g, beta = make_inputs(1, 40, 2, 16, 8, seed=4)
    q, k = q * 3, k * 5  # not normalised
    o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm=True, scale=0.3)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o_manual, _ = chunk_kda(qn * 0.3, kn, v, g, beta, scale=1.0, backend="reference")
    assert rel_rms(o, o_manual) <= TOL
    assert torch.allclose(l2norm(q), qn)


def test_default_scale_is_inverse_sqrt_k():
    q, k, v, g, beta = make_inputs(1, 20, 1, 16, 8)
    o, _ = chunk_kda(q, k, v, g, beta)
    o2, _ = chunk_kda(q * 0.25, k, v, g, beta, scale=1.0)
    assert rel_rms(o, o2) <= TOL


def test_final_state_only_when_asked():
    q, k, v, g, beta = make_inputs(1, 20, 1, 8, 8)
    for fn in (chunk_kda, recurrent_kda):
        assert fn(q, k, v, g, beta)[1] is None
        assert fn(q, k, v, g, beta, output_final_state=True)[1].dtype == torch.float32


def test_reference_backend_is_the_token_loop():
    inputs = make_inputs(2, 30, 2, 8, 8, seed=9)
    scale = 8**-0.5
    o, S = chunk_kda(*inputs, backend="reference", output_final_state=True)
    o2, S2 = naive_recurrent_kda(*inputs, scale, None, True)
    assert torch.equal(o, o2) and torch.equal(S, S2)
    # one step of the recurrence, written out
    q, k, v, g, beta = (x[:, :1] for x in inputs)
    S1 = beta[0, 0, :, None, None] * k[0, 0, :, :, None] * v[0, 0, :, None, :]
    assert torch.allclose(o[0, 0], torch.einsum("hk,hkv->hv", q[0, 0] * scale, S1), atol=1e-6)


def test_cpu_dispatch_and_triton_fallback(monkeypatch):
    inputs = make_inputs(1, 40, 2, 8, 8, seed=1)
    o_default, _ = chunk_kda(*inputs)
    o_torch, _ = chunk_kda(*inputs, backend="torch")
    assert torch.equal(o_default, o_torch)  # CPU tensors take the torch path
    monkeypatch.setattr(kda_mod, "_warned", set())
    monkeypatch.setattr(kda_mod, "_triton_chunk_kda", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o_tri, _ = chunk_kda(*inputs, backend="triton")
        chunk_kda(*inputs, backend="triton")
    assert torch.equal(o_tri, o_torch)
    assert sum("Triton" in str(w.message) for w in caught) == 1  # warned once


def test_triton_backend_refuses_cpu_tensors_without_interpreter(monkeypatch):
    inputs = make_inputs(1, 8, 1, 8, 8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(kda_mod, "_triton_chunk_kda", lambda *a, **k: pytest.fail("kernel launched on CPU"))
    with pytest.raises(ValueError, match="CUDA"):
        chunk_kda(*inputs, backend="triton")


def test_public_signatures_are_fixed():
    for fn in (chunk_kda, recurrent_kda):
        params = inspect.signature(fn).parameters
        assert list(params)[:5] == ["q", "k", "v", "g", "beta"]
        kw = [
            "scale",
            "initial_state",
            "output_final_state",
            "cu_seqlens",
            "use_qk_l2norm",
            "backend",
            "use_gate_in_kernel",
            "safe_gate",
            "lower_bound",
            "A_log",
            "dt_bias",
            "use_beta_sigmoid_in_kernel",
        ]
        assert [n for n in params if params[n].kind is inspect.Parameter.KEYWORD_ONLY] == kw


def _bad_cases():
    q, k, v, g, beta = make_inputs(1, 10, 2, 8, 4)
    ok = dict(q=q, k=k, v=v, g=g, beta=beta)
    yield "q", TypeError, dict(ok, q=q.numpy()), {}
    yield "q", ValueError, dict(ok, q=q[0]), {}
    yield "k", ValueError, dict(ok, k=k[..., :4]), {}
    yield "v", ValueError, dict(ok, v=v[:, :9]), {}
    yield "g", ValueError, dict(ok, g=g[..., 0]), {}
    yield "beta", ValueError, dict(ok, beta=beta[..., None]), {}
    yield "q, k and v", ValueError, dict(ok, v=v.double()), {}
    yield "beta", ValueError, dict(ok, beta=(beta > 0.5)), {}
    yield "initial_state", ValueError, ok, dict(initial_state=torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16))
    yield "initial_state", ValueError, ok, dict(initial_state=torch.zeros(2, 2, 8, 4))
    yield "initial_state", TypeError, ok, dict(initial_state=[0.0])
    yield "cu_seqlens", ValueError, ok, dict(cu_seqlens=torch.tensor([1, 10]))
    yield "cu_seqlens", ValueError, ok, dict(cu_seqlens=torch.tensor([0, 9]))
    yield "cu_seqlens", ValueError, ok, dict(cu_seqlens=torch.tensor([0, 6, 4, 10]))
    yield "cu_seqlens", ValueError, ok, dict(cu_seqlens=torch.tensor([0.0, 10.0]))
    yield (
        "cu_seqlens",
        ValueError,
        dict(ok, **{n: x.expand(2, *x.shape[1:]) for n, x in ok.items()}),
        dict(cu_seqlens=torch.tensor([0, 10])),
    )
    yield "scale", ValueError, ok, dict(scale=-1.0)
    yield "backend", ValueError, ok, dict(backend="cuda")
    yield "A_log", ValueError, ok, dict(A_log=torch.zeros(2))  # without use_gate_in_kernel
    yield "A_log", TypeError, ok, dict(use_gate_in_kernel=True)
    yield "A_log", ValueError, ok, dict(use_gate_in_kernel=True, A_log=torch.zeros(3))
    yield "dt_bias", ValueError, ok, dict(use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(8))
    # the safe gate: use_gate_in_kernel=True and a finite lower_bound < 0 are required
    yield "safe_gate", ValueError, ok, dict(safe_gate=True, lower_bound=-5.0)
    yield "lower_bound", ValueError, ok, dict(lower_bound=-5.0)
    yield "lower_bound", ValueError, ok, dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(2))
    for bad in (0.0, 2.0, float("nan"), float("-inf")):
        yield "lower_bound", ValueError, ok, dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=bad)
    yield "lower_bound", TypeError, ok, dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=torch.tensor(-5.0))
    yield (
        "A_log",
        ValueError,
        ok,
        dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=torch.zeros(3)),
    )


@pytest.mark.parametrize("name,exc,tensors,kwargs", list(_bad_cases()))
@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_bad_input_raises_naming_the_argument(fn, name, exc, tensors, kwargs):
    with pytest.raises(exc, match=name.split(",")[0]):
        fn(**tensors, **kwargs)


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_fused_gate_and_beta_sigmoid_equal_the_formulas(fn):
    """use_gate_in_kernel / use_beta_sigmoid_in_kernel on the torch path: the same as applying
    kda_gate and sigmoid first (gradients reach A_log and dt_bias)."""
    q, k, v, f, beta = make_inputs(1, 70, 2, 8, 8, seed=4)
    f, logits = f * -3.0, beta * 4 - 2
    A_log, dt_bias = torch.tensor([0.3, 2.0], requires_grad=True), torch.randn(2, 8, requires_grad=True)
    o, S = fn(
        q,
        k,
        v,
        f,
        logits,
        output_final_state=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True,
    )
    o_ref, S_ref = fn(
        q,
        k,
        v,
        kda_mod.kda_gate(f, A_log.detach(), dt_bias.detach().flatten()),
        torch.sigmoid(logits),
        output_final_state=True,
    )
    assert rel_rms(o, o_ref) <= 1e-6 and rel_rms(S, S_ref) <= 1e-6
    o.sum().backward()
    assert A_log.grad.abs().sum() > 0 and dt_bias.grad.abs().sum() > 0


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_positive_or_nan_g_is_refused_on_cpu(fn):
    """g is a log-decay: g > 0 overflowed the chunk path's exponentials into inf/NaN outputs, silently."""
    q, k, v, g, beta = make_inputs(1, 70, 2, 8, 8, seed=5)
    for bad in (0.5, float("nan")):
        g_bad = g.clone()
        g_bad[0, 40, 1, 3] = bad
        with pytest.raises(ValueError, match=r"^g must be a log-decay"):
            fn(q, k, v, g_bad, beta)
    # with use_gate_in_kernel, g is the raw forget input: positive values are valid
    o, _ = fn(q, k, v, g.abs() * 3, beta, use_gate_in_kernel=True, A_log=torch.zeros(2))
    assert torch.isfinite(o).all()


def _small_inputs():
    q, k, v, g, beta = make_inputs(1, 16, 2, 8, 8, seed=6)
    return q, k, v, g, beta, torch.tensor([0, 5, 16])


def test_value_checks_do_not_break_compile_or_export():
    """The checks that read tensor values (g <= 0, cu_seqlens) are skipped while tracing: fullgraph
    compile and export of the op succeed. (With cu_seqlens the packed layout itself is
    data-dependent, so the input checks are compiled on their own there.)"""
    q, k, v, g, beta, cu = _small_inputs()
    torch._dynamo.reset()

    def reference(q, k, v, g, beta):
        return chunk_kda(q, k, v, g, beta, backend="reference")[0]

    compiled = torch.compile(reference, fullgraph=True, backend="eager")(q, k, v, g, beta)
    assert torch.allclose(compiled, reference(q, k, v, g, beta), atol=1e-6)

    class Op(torch.nn.Module):
        def forward(self, q, k, v, g, beta):
            return chunk_kda(q, k, v, g, beta)[0]

    exported = torch.export.export(Op(), (q, k, v, g, beta)).module()
    assert torch.allclose(exported(q, k, v, g, beta), Op()(q, k, v, g, beta), atol=1e-6)

    def checks(q, k, v, g, beta, cu):
        scale, n = kda_mod._check_inputs(q, k, v, g, beta, None, None, cu, None)
        return q * scale + n

    assert torch.equal(torch.compile(checks, fullgraph=True, backend="eager")(q, k, v, g, beta, cu), q * 8**-0.5 + 2)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# Kimi K3's safe gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_A_log", [True, False])
@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_safe_gate_matches_the_fp64_formula(fn, backend, with_A_log):
    """chunk_kda / recurrent_kda(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5) in fp32, packed
    sequences (one spans two chunks, one is empty) with initial states: outputs, final states and the
    gradients of every input (A_log and dt_bias included) against the fp64 gate formula fed to the fp64
    token loop."""
    cu = torch.tensor([0, 9, 9, 75])
    q, k, v, f, beta, A_log, dt_bias, h0 = safe_gate_inputs(75, 2, 8, 8, 3, seed=21)
    A_log = A_log if with_A_log else None
    tensors = [q, k, v, f, beta, h0, dt_bias] + ([A_log] if with_A_log else [])
    gen = torch.Generator().manual_seed(5)
    w_o, w_S = torch.randn(v.shape, generator=gen, dtype=torch.float64), torch.randn(h0.shape, generator=gen)

    def run(dtype, ours):
        xs = [x.detach().to(dtype).requires_grad_() for x in tensors]
        q_, k_, v_, f_, b_, h_, bias_ = xs[:7]
        A_ = xs[7] if with_A_log else None
        if ours:
            gate = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, A_log=A_, dt_bias=bias_)
            o, S = fn(
                q_, k_, v_, f_, b_, initial_state=h_, output_final_state=True, cu_seqlens=cu, backend=backend, **gate
            )
        else:
            g = safe_gate_fp64(f_, A_, bias_, LOWER_BOUND)
            o, S = fn(q_, k_, v_, g, b_, initial_state=h_, output_final_state=True, cu_seqlens=cu, backend="reference")
        ((o.double() * w_o).sum() + (S.double() * w_S.double()).sum()).backward()
        return o, S, [x.grad for x in xs]

    o, S, grads = run(torch.float32, ours=True)
    o_ref, S_ref, grads_ref = run(torch.float64, ours=False)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= TOL and rel_rms(S, S_ref) <= TOL
    assert torch.equal(S[1], h0[1])  # the empty sequence
    names = ["q", "k", "v", "f", "beta", "h0", "dt_bias", "A_log"]
    for name, a, b in zip(names, grads, grads_ref):
        assert a.dtype == torch.float32 and torch.isfinite(a).all(), name
        assert rel_rms(a, b) <= TOL, (name, rel_rms(a, b))


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_safe_gate_gradcheck_float64(fn, backend):
    """Exact-arithmetic gradients of the safe gate's inputs f, A_log and dt_bias through the whole op
    (packed sequences, initial states), on tiny shapes."""
    cu = torch.tensor([0, 2, 7])
    q, k, v, f, beta, A_log, dt_bias, h0 = (x.double() for x in safe_gate_inputs(7, 2, 4, 3, 2, seed=8))
    f = f / 6  # away from saturation: finite differences see the curvature

    def op(f, A_log, dt_bias):
        gate = dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND, A_log=A_log, dt_bias=dt_bias)
        return fn(q, k, v, f, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend, **gate)

    # fast_mode: random projections of the Jacobian (the full one costs ~10 s on the chunked path); the test
    # above compares every gradient elementwise with the fp64 formula
    assert torch.autograd.gradcheck(op, tuple(x.requires_grad_() for x in (f, A_log, dt_bias)), fast_mode=True)


@pytest.mark.parametrize("fn", [chunk_kda, recurrent_kda])
def test_lower_bound_selects_the_bounded_gate_as_in_fla(fn):
    """fla's semantics: with use_gate_in_kernel=True the formula follows lower_bound (safe_gate=True only
    insists on one): the same results with or without safe_gate; A_log=None means exp(A_log) = 1."""
    q, k, v, f, beta, A_log, dt_bias, _ = safe_gate_inputs(70, 2, 8, 8, 1, seed=3)
    gate = dict(use_gate_in_kernel=True, lower_bound=LOWER_BOUND, dt_bias=dt_bias)
    o_safe, S_safe = fn(q, k, v, f, beta, output_final_state=True, safe_gate=True, A_log=A_log, **gate)
    o, S = fn(q, k, v, f, beta, output_final_state=True, A_log=A_log, **gate)
    assert torch.equal(o, o_safe) and torch.equal(S, S_safe)
    o_none, _ = fn(q, k, v, f, beta, safe_gate=True, **gate)
    o_zero, _ = fn(q, k, v, f, beta, safe_gate=True, A_log=torch.zeros(2), **gate)  # exp(0) = 1
    assert rel_rms(o_none, o_zero) <= 1e-6
    # and it is not Kimi-Linear's gate
    o_plain, _ = fn(q, k, v, f, beta, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    assert rel_rms(o_plain, o) > 1e-2


def test_kda_gate_safe_gate_is_bounded_fp32_and_the_formula():
    f = torch.randn(2, 5, 3, 4, dtype=torch.bfloat16) * 4
    f[0, 0, 0] = torch.tensor([1e4, -1e4, 0.0, 88.0])
    A_log, dt_bias = torch.tensor([0.0, 1.0, -1.0]), torch.randn(12)
    g = kda_mod.kda_gate(f, A_log, dt_bias, lower_bound=LOWER_BOUND)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()
    assert (g >= LOWER_BOUND).all() and (g <= 0).all()
    assert torch.allclose(g.double(), safe_gate_fp64(f, A_log, dt_bias, LOWER_BOUND), rtol=1e-6, atol=1e-6)
    assert torch.allclose(kda_mod.kda_gate(f, None, dt_bias, -2.0).double(), safe_gate_fp64(f, None, dt_bias, -2.0))
    with pytest.raises(ValueError, match="A_log"):
        kda_mod.kda_gate(f)  # Kimi-Linear's gate needs A_log
