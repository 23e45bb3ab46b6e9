"""Inputs and comparisons shared by the KDA tests (tests/ops/test_kda.py, tests/kernels/kda/): seeded random
inputs, a relative RMS error, a backward pass through a fixed random weighting of the outputs, and Kimi K3's safe
gate written out in fp64."""

import torch
import torch.nn.functional as F


TOL = 1e-4  # relative RMS error allowed in fp32 (outputs, final states, gradients)


def rel_rms(a, b):
    """The RMS of a - b over the RMS of b, in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(B, T, H, K, V, *, gate=1.0, dtype=torch.float32, seed=0, strong_channels=0):
    """Seeded [q, k (unit norm), v, g (log decay in [-gate, 0]; -30 on the first strong_channels), beta]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * gate
    if strong_channels:
        g[..., :strong_channels] = -30.0  # per-step decay of e^-30 on some channels
    beta = torch.rand(B, T, H, generator=gen)
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def run_with_grads(fn, inputs, h0, weights=None, **kw):
    """Runs fn and backpropagates a fixed random weighting (w_o, w_S) of o and the final state;
    returns o, S and the gradients of the inputs (and of h0)."""
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    h = None if h0 is None else h0.detach().clone().requires_grad_()
    o, S = fn(*xs, initial_state=h, output_final_state=True, **kw)
    if weights is None:
        gen = torch.Generator().manual_seed(123)
        weights = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen)
    loss = (o.float() * weights[0]).sum() + (S * weights[1]).sum()
    loss.backward()
    grads = [x.grad for x in xs] + ([] if h is None else [h.grad])
    return o, S, grads


# Kimi K3's safe gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
LOWER_BOUND = -5.0  # Kimi K3's value


def safe_gate_fp64(f, A_log, dt_bias, lower_bound):
    """The K3 gate written out in fp64, independently of kda_gate: dt_bias added to f first, times the
    per-head exp(A_log) (1 without A_log, as in fla), sigmoid, times lower_bound. f [B, T, H, K]."""
    H, K = f.shape[-2:]
    x = f.double() + dt_bias.double().reshape(H, K)
    if A_log is not None:
        x = A_log.double().exp().reshape(H, 1) * x
    return lower_bound / (1.0 + torch.exp(-x))


def safe_gate_inputs(T, H, K, V, N, seed):
    """q, k, v, f (raw forget input, either sign, some channels saturating both ends), beta, A_log, dt_bias, h0."""
    q, k, v, f, beta = make_inputs(1, T, H, K, V, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    f = torch.randn(f.shape, generator=gen) * 3
    f[..., 0], f[..., 1] = 30.0, -30.0  # sigmoid saturated: g = lower_bound (the strongest decay) and g = 0
    A_log = torch.linspace(-0.5, 1.0, H)
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    h0 = torch.randn(N, H, K, V, generator=gen)
    return q, k, v, f, beta, A_log, dt_bias, h0


def safe_gate_prefix_run(xs, cut, **kw):
    """Kimi K3's chunk_kda (safe gate fused: use_gate_in_kernel with A_log, dt_bias and lower_bound; sigmoid(beta),
    the L2 norm, an initial state) on xs = (q, k, v, f, beta, A_log, dt_bias, h0) as `safe_gate_inputs` returns
    them, and a backward of a fixed random weighting of the outputs before position `cut` only.
    Returns o and the gradients of the 8 inputs."""
    from kimi_hf.ops import chunk_kda

    leaves = [x.detach().clone().requires_grad_() for x in xs]
    q, k, v, f, beta, A_log, dt_bias, h0 = leaves
    o, _ = chunk_kda(
        q,
        k,
        v,
        f,
        beta,
        initial_state=h0,
        use_qk_l2norm=True,
        use_gate_in_kernel=True,
        safe_gate=True,
        lower_bound=LOWER_BOUND,
        A_log=A_log,
        dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=True,
        **kw,
    )
    w = torch.randn(o[:, :cut].shape, generator=torch.Generator().manual_seed(7), dtype=o.dtype)
    (o[:, :cut] * w).sum().backward()
    return o.detach(), [x.grad for x in leaves]


def changed_after(xs, cut, seed):
    """xs with q, k, v, f and beta replaced from position `cut` on: new random values, f at +30 on every channel
    (the gate saturated at lower_bound: the strongest decay, an e^(5 * 64) range of decays over a chunk)."""
    gen = torch.Generator().manual_seed(seed)
    out = [x.clone() for x in xs]
    for i in range(5):
        new = torch.randn(out[i][:, cut:].shape, generator=gen, dtype=out[i].dtype) * 4
        out[i][:, cut:] = 30.0 if i == 3 else new
    return out


def assert_causal_prefix(xs, cut, **kw):
    """Changing q, k, v, f and beta from position `cut` on (`changed_after`) leaves, bit for bit, the outputs before
    `cut` and every gradient of a loss on them (`safe_gate_prefix_run`): the per-token gradients before `cut`
    equal and exactly 0 from it on, those of A_log, dt_bias and the initial state equal. kw: chunk_kda's backend."""
    o, grads = safe_gate_prefix_run(xs, cut, **kw)
    o_changed, grads_changed = safe_gate_prefix_run(changed_after(xs, cut, seed=cut + 1), cut, **kw)
    assert not torch.equal(o[:, cut:], o_changed[:, cut:])  # the change reached the outputs from `cut` on
    assert torch.equal(o[:, :cut], o_changed[:, :cut]), (o[:, :cut] - o_changed[:, :cut]).abs().max()
    names = ["q", "k", "v", "f", "beta", "A_log", "dt_bias", "h0"]
    for i, (name, a, b) in enumerate(zip(names, grads, grads_changed)):
        if i < 5:  # per token [B, T, ...]
            assert torch.equal(a[:, :cut], b[:, :cut]), (name, (a[:, :cut] - b[:, :cut]).abs().max())
            assert not a[:, cut:].any() and not b[:, cut:].any(), name
        else:
            assert torch.equal(a, b), (name, (a - b).abs().max())
