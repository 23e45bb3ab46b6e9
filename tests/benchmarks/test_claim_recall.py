"""benchmarks/claims/recall.py (`kimi-hf bench claims recall`): its MQAR batches hold what they say (every query's
target is its key's value), its per-head variant of KDA's gate really shares one decay per head (and only the gate
differs from KDA), and its --quick smoke prints well-formed tables (one row per model, numbers that parse),
results.json and the plot; bad arguments give a one-line usage error. The claim itself is not asserted: three steps
say nothing about it."""

import json
import re
import sys

import pytest
import torch

from .claims_helpers import CLAIMS, run_claim, seeds_mean
from .test_benchmark_scripts import markdown_tables


SCRIPT = CLAIMS / "recall.py"
sys.path.insert(0, str(CLAIMS))

import recall  # noqa: E402  (benchmarks/claims/recall.py)

from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiDeltaAttention  # noqa: E402
from kimi_hf.ops.kda import kda_gate  # noqa: E402


LABELS = [recall.ARMS[n][0] for n in ("kda", "gdn", "mla", "hybrid")]
HEADERS = [
    "| model | params | T=256 | T=512 |",
    "| model | T=256 | T=512 |",
    "| dt_bias init | final accuracy | steps to 90% |",
]


def run(*args, timeout=300):
    return run_claim(SCRIPT, *args, timeout=timeout)


def steps_value(cell: str) -> float | None:
    """`never (0/n)` or `<seeds cell> (k/n)`: the mean steps, None for never."""
    m = re.fullmatch(r"(.+) \((\d+)/(\d+)\)", cell)
    assert m and int(m.group(2)) <= int(m.group(3)), cell
    if m.group(1) == "never":
        assert m.group(2) == "0", cell
        return None
    return seeds_mean(m.group(1))


# ---- the task and the models -------------------------------------------------------------------------------------


def test_mqar_batch_asks_the_pairs_keys_among_noise_and_targets_their_values():
    gen = torch.Generator().manual_seed(0)
    x, query, values = recall.mqar_batch(gen, 3, 64, 8)
    assert x.shape == query.shape == (3, 64) and values.shape == (3 * 24,)  # (64 - 16) / 2 queries a sequence
    assert not query[:, :16].any() and (query.sum(1) == 24).all()
    for b in range(3):
        keys, vals = x[b, 0:16:2].tolist(), x[b, 1:16:2].tolist()
        assert len(set(keys)) == 8 and all(recall.KEY0 <= k < recall.VALUE0 for k in keys)
        assert all(recall.VALUE0 <= v < recall.NOISE0 for v in vals)
        pairs = dict(zip(keys, vals))
        asked = x[b][query[b]].tolist()
        assert [pairs[k] for k in asked] == values[24 * b : 24 * (b + 1)].tolist()
        rest = x[b, 16:][~query[b, 16:]]
        assert ((rest >= recall.NOISE0) & (rest < recall.NOISE0 + recall.N_NOISE)).all()  # the rest is noise
    again = recall.mqar_batch(torch.Generator().manual_seed(0), 3, 64, 8)
    assert all(torch.equal(a, b) for a, b in zip((x, query, values), again))  # seeded


def gates(model):
    """Each KDA layer's log-decay g [B, T, H, K] on a random input, with the layer's own gate parameters."""
    out = []
    h = torch.randn(2, 5, model.config.hidden_size)
    for m in model.modules():
        if isinstance(m, KimiDeltaAttention):
            f = m.f_b_proj(m.f_a_proj(h)).view(2, 5, m.num_heads, m.head_dim)
            out.append(kda_gate(f, m.A_log, m.dt_bias))
    return out


def test_the_gdn_variant_shares_one_decay_a_head_and_differs_from_kda_only_in_the_gate():
    kda, gdn = recall.build("kda", 32, 0), recall.build("gdn", 32, 0)
    for g in gates(gdn):  # one decay per head and token, the same for its K channels
        assert g.dtype == torch.float32 and torch.equal(g, g[..., :1].expand_as(g))
    for g in gates(kda):  # per channel
        assert not torch.allclose(g, g[..., :1].expand_as(g))
    names = {n.replace(".parametrizations.", ".").removesuffix(".original") for n, _ in gdn.named_parameters()}
    assert names == {n for n, _ in kda.named_parameters()}  # the same modules; only the gate is reparametrized
    heads, K = 2, 16
    tied = {n: p.shape for n, p in gdn.named_parameters() if "parametrizations" in n}
    assert tied == {
        **{f"model.layers.{i}.self_attn.parametrizations.dt_bias.original": (heads,) for i in range(2)},
        **{f"model.layers.{i}.self_attn.f_b_proj.parametrizations.weight.original": (heads, K) for i in range(2)},
    }
    assert recall.parameter_count(kda) - recall.parameter_count(gdn) == 2 * (heads * K - heads) * (K + 1)
    # the shared parameters learn: a loss reaches them through every channel of their head
    x = torch.randint(0, recall.VOCAB, (1, 8))
    gdn(input_ids=x).logits.sum().backward()
    layer = gdn.model.layers[0].self_attn
    assert layer.parametrizations.dt_bias.original.grad.abs().min() > 0


def test_dt_bias_initialisations():
    for name in ("kda", "gdn"):  # Kimi Linear's: softplus(dt_bias) = dt in [1e-3, 1e-1]
        for m in recall.build(name, 32, 1).modules():
            if isinstance(m, KimiDeltaAttention):
                dt = torch.nn.functional.softplus(m.dt_bias)
                assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    layers = [m for m in recall.build("kda-dt0", 32, 1).modules() if isinstance(m, KimiDeltaAttention)]
    assert len(layers) == 2 and all(torch.count_nonzero(m.dt_bias) == 0 for m in layers)


# ---- the script ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("recall")
    result = run("--quick", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, out


def test_quick_prints_one_row_a_model_with_numbers_that_parse(quick):
    stdout, _ = quick
    tables = markdown_tables(stdout)
    assert [header for header, _ in tables] == HEADERS, stdout
    (_, accuracy), (_, steps), (_, dt_bias) = tables
    assert [row[0] for row in accuracy] == [row[0] for row in steps] == LABELS
    for row in accuracy:
        assert int(row[1]) > 0
        assert all(0.0 <= seeds_mean(c) <= 1.0 for c in row[2:]), row
    for row in steps:
        assert all(steps_value(c) is None or steps_value(c) >= 1 for c in row[1:]), row
    assert [row[0].split(":")[0] for row in dt_bias] == ["Kimi Linear's", "zeros"]
    for row in dt_bias:
        assert 0.0 <= seeds_mean(row[1]) <= 1.0 and (steps_value(row[2]) or 1) >= 1, row


def test_quick_writes_results_json_and_the_plot(quick):
    _, out = quick
    results = json.loads((out / "results.json").read_text())
    assert results["claim"] == "recall" and results["setup"]["quick"] is True
    assert set(results["summary"]) == set(recall.ALL_ARMS)
    assert set(results["summary"]["kda"]) == {"256", "512"} and set(results["summary"]["kda-dt0"]) == {"256"}
    runs = {(r["arm"], r["T"], r["seed"]) for r in results["runs"]}
    assert runs == {(a, T, 0) for a in recall.ARMS for T in (256, 512)} | {("kda-dt0", 256, 0)}
    for r in results["runs"]:
        assert r["curve"] and all(0.0 <= a <= 1.0 for _, a in r["curve"]) and r["final"] == r["curve"][-1][1]
    for name, n in results["setup"]["params"].items():
        assert name in recall.ALL_ARMS and n > 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "recall.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps: expected a positive integer"),
        (["--arms", "rwkv"], "invalid choice: 'rwkv'"),
        (["--lengths", "32"], "--lengths must be at least 4 x --pairs"),
        (["--pairs", "65"], "--pairs must be at most 64"),
        (["--lr", "nan"], "--lr must be a positive number"),
        (["--batch-tokens", "256"], "--batch-tokens must hold a sequence"),
    ],
)
def test_bad_arguments_give_a_one_line_usage_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        recall.parse_args(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err.strip().splitlines()[-1], err


def test_bad_arguments_from_the_command_line():
    result = run("--hidden", "33", timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "--hidden must be even" in result.stderr.strip().splitlines()[-1], result.stderr
