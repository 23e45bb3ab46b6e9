"""benchmarks/claims/recall.py (`kimi-hf bench claims recall`): its MQAR batches hold what they say (every query's
target is its key's value), so do its Palindrome batches (the symbols, noise, the separator, the reversal as targets),
its per-head variant of KDA's gate really shares one decay per head (and only the gate differs from KDA), and its
--quick smoke prints well-formed tables (one row per model, numbers that parse), results.json and the plot; bad
arguments give a one-line usage error. The claim itself is not asserted: three steps
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
    *["| model | params | T=256 | T=512 |", "| model | T=256 | T=512 |"] * 2,  # MQAR's, then Palindrome's
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


def test_palindrome_batch_holds_the_symbols_noise_the_separator_and_the_reversal_as_targets():
    gen = torch.Generator().manual_seed(0)
    x, query, targets = recall.palindrome_batch(gen, 3, 40, 8)
    assert x.shape == query.shape == (3, 40) and targets.shape == (3 * 8,)
    assert (query.sum(1) == 8).all() and query[:, 32:].all()  # answers from the separator (position 40 - 8) on
    for b in range(3):
        symbols = x[b, :8].tolist()
        assert all(recall.KEY0 <= s < recall.KEY0 + recall.N_KEYS for s in symbols)
        gap = x[b, 8:32]
        assert ((gap >= recall.NOISE0) & (gap < recall.NOISE0 + recall.N_NOISE)).all()
        assert x[b, 32] == recall.SEPARATOR and not recall.NOISE0 <= recall.SEPARATOR < recall.KEY0 + recall.N_KEYS
        assert targets[8 * b : 8 * (b + 1)].tolist() == symbols[::-1]  # c_N .. c_1
        assert x[b, 33:].tolist() == symbols[::-1][:-1]  # teacher forcing: the answer so far is the input
    pure, _, _ = recall.palindrome_batch(gen, 2, 16, 8)  # no room for noise: the paper's palindrome
    assert (pure[:, 8] == recall.SEPARATOR).all() and pure[:, :8].lt(recall.NOISE0).all()
    again = recall.palindrome_batch(torch.Generator().manual_seed(0), 3, 40, 8)
    assert all(torch.equal(a, b) for a, b in zip((x, query, targets), again))  # seeded
    with pytest.raises(ValueError, match="do not fit in 15 tokens"):
        recall.palindrome_batch(gen, 1, 15, 8)


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
    *per_task, (_, dt_bias) = tables
    titles = re.findall(r"^\*\*(.+?)\*\*$", stdout, flags=re.M)
    assert [t.split()[0].rstrip(":") for t in titles] == ["MQAR", "MQAR", "Palindrome", "Palindrome", "KDA's"], titles
    for (_, accuracy), (_, steps) in zip(per_task[::2], per_task[1::2]):
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
    mqar, palindrome = results["summary"]["mqar"], results["summary"]["palindrome"]
    assert set(results["summary"]) == {"mqar", "palindrome"} and set(palindrome) == set(recall.ARMS)
    assert set(mqar) == set(recall.ALL_ARMS)  # the dt_bias ablation runs on MQAR, at the first length
    assert set(mqar["kda"]) == set(palindrome["kda"]) == {"256", "512"} and set(mqar["kda-dt0"]) == {"256"}
    assert results["setup"]["tasks"]["palindrome"]["size"] == {"256": 128, "512": 256}  # half the sequence
    runs = {(r["task"], r["arm"], r["T"], r["seed"]) for r in results["runs"]}
    every = {(task, a, T, 0) for task in ("mqar", "palindrome") for a in recall.ARMS for T in (256, 512)}
    assert runs == every | {("mqar", "kda-dt0", 256, 0)}
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
        (["--steps", "0"], "--steps: must be a positive integer, got 0"),
        (["--lengths", "x"], "--lengths: must be a positive integer, got x"),
        (["--arms", "rwkv"], "invalid choice: 'rwkv'"),
        (["--lengths", "32"], "--lengths must be at least 4 x --pairs"),
        (["--pairs", "65"], "--pairs must be at most 64"),
        (["--tasks", "stack"], "invalid choice: 'stack'"),
        (["--tasks", "palindrome", "--arms", "kda-dt0"], "the dt_bias ablation runs on MQAR only"),
        (["--tasks", "palindrome", "--content", "129"], "--lengths must be at least 2 x --content = 258"),
        (["--lr", "nan"], "--lr must be a positive number"),
        (["--batch-tokens", "256"], "--batch-tokens must hold a sequence"),
    ],
)
def test_bad_arguments_give_a_one_line_usage_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        recall.parse_args(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err.strip().splitlines()[-1], err


def test_repeated_choices_run_once():
    args = recall.parse_args(
        ["--tasks", "palindrome", "mqar", "palindrome", "--arms", "gdn", "gdn", "--lengths", "256"]
    )
    assert args.tasks == ["palindrome", "mqar"] and args.arms == ["gdn"] and args.lengths == [256]


def test_bad_arguments_from_the_command_line():
    result = run("--hidden", "33", timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "--hidden must be even" in result.stderr.strip().splitlines()[-1], result.stderr
