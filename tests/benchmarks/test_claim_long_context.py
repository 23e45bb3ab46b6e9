"""benchmarks/claims/long_context.py --quick (`kimi-hf bench claims long-context --quick`) runs end to end: its four
tables are well formed (headers, one row per context length or model, numbers that parse), results.json holds the
same rows, the cache bytes are exactly what the config's shapes give (they are deterministic; the timings are not
checked: machines are noisy), and bad arguments are a one-line argparse error."""

import importlib.util
import json

import pytest

from .claims_helpers import CLAIMS, run_claim


SCRIPT = CLAIMS / "long_context.py"
QUICK_CONTEXTS = [1024, 2048]
CHECK_CONTEXT = 256

CHECK = ["model", "T", "prefilled ms/token", "synthetic ms/token", "spread", "synthetic / prefilled", "same layout"]
DECODE = [
    "T",
    "hybrid ms/token",
    "all-MLA ms/token",
    "spread",
    "all-MLA / hybrid time",
    "hybrid cache MB",
    "all-MLA cache MB",
    "hybrid / all-MLA cache",
    "peak RSS GB",
]
FIT = ["model", "a ms", "b ms per 100k tokens", "max rel. residual"]
EXTRAPOLATION = ["T", "paper", "ours measured", "ours fit", "48B memory-traffic estimate (B=1)"]


def run(*args, timeout=300):
    return run_claim(SCRIPT, *args, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("long_context")
    proc = run("--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, out, json.loads((out / "results.json").read_text())


def titled_tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of each `**title**` followed by a markdown table (report.print_table's layout)."""

    def cells(line):
        return [c.strip() for c in line.strip()[1:-1].split("|")]

    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        if not (line.startswith("**") and line.endswith("**")):
            continue
        assert lines[i + 1] == "", lines[i : i + 3]
        headers = cells(lines[i + 2])
        assert lines[i + 3] == "|" + "|".join("---" for _ in headers) + "|", lines[i + 3]
        rows, j = [], i + 4
        while j < len(lines) and lines[j].startswith("|"):
            assert len(cells(lines[j])) == len(headers), (headers, lines[j])
            rows.append(cells(lines[j]))
            j += 1
        out.append((line.strip("*"), headers, rows))
    return out


def mla_bytes_per_token(model: dict) -> int:
    """fp32 latent (kv_lora_rank) + shared rope key (qk_rope_head_dim) per token of one MLA layer."""
    return (model["kv_lora_rank"] + model["qk_rope_head_dim"]) * 4


def kda_state_bytes(model: dict) -> int:
    """One KDA layer, whatever T: the last kernel - 1 inputs of the q, k, v convolutions and the [H, K, K] state."""
    H, K, W = model["linear_num_heads"], model["linear_head_dim"], model["linear_conv_kernel_dim"]
    return 3 * H * K * (W - 1) * 4 + H * K * K * 4


def expected_bytes(setup: dict, T: int) -> tuple[int, int]:
    model, types = setup["model"], setup["hybrid_layer_types"]
    n_mla = types.count("full_attention")
    hybrid = n_mla * T * mla_bytes_per_token(model) + (len(types) - n_mla) * kda_state_bytes(model)
    return hybrid, model["num_hidden_layers"] * T * mla_bytes_per_token(model)


def test_quick_prints_four_well_formed_tables(quick):
    stdout, _, _ = quick
    tables = titled_tables(stdout)
    assert [headers for _, headers, _ in tables] == [CHECK, DECODE, FIT, EXTRAPOLATION], stdout
    (_, _, check), (_, _, decode), (_, _, fit), (_, _, extra) = tables

    assert [row[:2] for row in check] == [["hybrid", str(CHECK_CONTEXT)], ["all-MLA", str(CHECK_CONTEXT)]]
    for row in check:
        [float(c) for c in (row[2], row[3], row[5])]
        assert row[6] == "yes"

    assert [int(row[0]) for row in decode] == QUICK_CONTEXTS  # one row per context length
    for row in decode:
        for c in row[1:3] + row[4:]:  # one seed: plain numbers
            assert float(c) >= 0, row
        assert row[3].rstrip(" !").endswith("%") or row[3] == "n/a"

    assert [row[0] for row in fit] == ["hybrid", "all-MLA"]
    for row in fit:
        float(row[1]), float(row[2]), float(row[3].rstrip("%"))

    assert [row[0] for row in extra] == ["524288", "1048576", "inf"]
    assert [row[1] for row in extra] == ["2.3x*", "6.3x", "-"]  # the paper; 2.3x marked: SPEC gives it as prefill
    assert [row[2] for row in extra] == ["-", "-", "-"]  # --quick stops at 2k
    for row in extra:
        assert row[3].endswith("x") and row[4].endswith("x")
        float(row[3][:-1]), float(row[4][:-1])
    assert "spread" in stdout and "extrapolation" in stdout


def test_quick_cache_bytes_follow_the_config(quick):
    stdout, _, results = quick
    setup = results["setup"]
    assert setup["contexts"] == QUICK_CONTEXTS and setup["quick"] and setup["seeds"] == [0]
    assert setup["hybrid_layer_types"].count("full_attention") == 1 and setup["model"]["num_hidden_layers"] == 4
    decode = titled_tables(stdout)[1][2]
    assert [r["T"] for r in results["rows"]] == QUICK_CONTEXTS
    for row, printed in zip(results["rows"], decode):
        hybrid, mla = expected_bytes(setup, row["T"])
        assert (row["hybrid_bytes"], row["mla_bytes"]) == (hybrid, mla)
        assert row["cache_ratio"] == pytest.approx(hybrid / mla)
        assert printed[5:8] == [f"{hybrid / 2**20:.3f}", f"{mla / 2**20:.3f}", f"{hybrid / mla:.3f}"]
        assert len(row["hybrid_ms"]) == len(row["mla_ms"]) == len(row["ratio"]) == 1
    # the check's caches, synthetic and prefilled, hold the same layout and these bytes
    assert [(c["model"], c["T"], c["same_layout"]) for c in results["check"]] == [
        ("hybrid", CHECK_CONTEXT, True),
        ("all-MLA", CHECK_CONTEXT, True),
    ]
    assert [c["bytes"] for c in results["check"]] == list(expected_bytes(setup, CHECK_CONTEXT))


def test_quick_memory_traffic_estimate_of_the_48b_config(quick):
    """Kimi-Linear-48B at B=1: 3B active bf16 weights + 7 (hybrid) or 27 (all-MLA) layers of 576 bf16 latent values
    per token, + 20 KDA layers' fp32 [32, 128, 128] states and bf16 conv tails (4096 x 3 x 3)."""
    _, _, results = quick
    weights, latent = 3e9 * 2, 576 * 2
    kda = 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2)
    for e in results["extrapolation"]:
        if e["T"] is None:
            assert e["traffic_48b"] == pytest.approx(27 / 7)
        else:
            T = e["T"]
            assert e["traffic_48b"] == pytest.approx((weights + 27 * latent * T) / (weights + 7 * latent * T + kda))


def test_quick_writes_the_plot(quick):
    _, out, _ = quick
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib not installed: no plot")
    assert (out / "long_context.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", "0"], "argument --tokens: must be a positive integer, got 0"),
        (["--contexts", "1024", "-5"], "argument --contexts: must be a positive integer, got -5"),
        (["--cache", "paged"], "argument --cache: invalid choice: 'paged'"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, message):
    proc = run(*args, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr.strip().splitlines()[-1]
