"""benchmarks/claims/hybrid_ratio.py (`kimi-hf bench claims hybrid-ratio`) runs its --quick smoke and prints well-formed
tables (one row per ratio, numbers that parse), a verdict line, OUT/results.json and the plot; bad arguments give a
one-line usage error. The claim itself (3:1 best) is not asserted: a few steps say nothing about it."""

import json
import math
import re

from .claims_helpers import CLAIMS, NUMBER, run_claim, seeds_mean
from .test_benchmark_scripts import markdown_tables


SCRIPT = CLAIMS / "hybrid_ratio.py"
RATIOS = ["0:1", "1:1", "3:1", "7:1", "1:0"]
PATTERNS = ["MMMMMMMM", "KMKMKMKM", "KKKMKKKM", "KKKKKKKM", "KKKKKKKK"]
HEADERS = [
    "| ratio | layers | MLA layers | params | vs 3:1 | s/step (median) | CPU s / run |",
    "| ratio | train loss | val loss | val bits / byte | val perplexity / byte | Kimi Linear train / val ppl |",
    "| ratio | per seed | mean ± std [min, max] | seeds where 3:1 is lower |",
]


def run(*args, timeout=300):
    return run_claim(SCRIPT, *args, timeout=timeout)


def test_quick_run_prints_one_row_per_ratio_and_writes_results(tmp_path):
    out = run("--quick", "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    tables = markdown_tables(out.stdout)
    assert [header for header, _ in tables] == HEADERS, out.stdout
    (_, models), (_, losses), (_, paired) = tables

    assert [row[:3] for row in models] == [[r, p, str(p.count("M"))] for r, p in zip(RATIOS, PATTERNS)]
    params = [int(row[3].replace(",", "")) for row in models]
    assert params[2] > 0 and all(int(row[4].replace(",", "")) == n - params[2] for row, n in zip(models, params))
    assert max(params) - min(params) < 0.01 * params[2]  # equal sizes: the setup, not the claim
    for row in models:
        assert seeds_mean(row[5]) > 0 and seeds_mean(row[6]) >= 0

    assert [row[0] for row in losses] == RATIOS
    for row in losses:
        train, val, bits, ppl = (seeds_mean(c) for c in row[1:5])
        assert 0 < train < 10 and 0 < val < 10
        assert math.isclose(bits, val / math.log(2), rel_tol=1e-3, abs_tol=1e-3)
        assert math.isclose(ppl, math.exp(val), rel_tol=1e-3, abs_tol=1e-3)
    assert [row[5] for row in losses] == ["9.45 / 5.77", "9.29 / 5.66", "9.23 / 5.65", "9.23 / 5.70", "-"]

    assert [row[0] for row in paired] == [r for r in RATIOS if r != "3:1"]
    for row in paired:
        assert re.fullmatch(NUMBER, row[1]) and re.fullmatch(r"[01]/1", row[3]), row
        assert math.isclose(float(row[1]), seeds_mean(row[2]), abs_tol=1e-4)
    assert re.search(r"^3:1 (wins|does not win) at this scale", out.stdout, re.M), out.stdout

    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["quick"] is True and results["setup"]["seeds"] == [0]
    models = results["models"]  # results.json sorts its keys
    assert [models[r]["pattern"] for r in RATIOS] == PATTERNS and all(
        len(m["layer_types"]) == 8 for m in models.values()
    )
    assert sorted(r["ratio"] for r in results["runs"]) == sorted(RATIOS)
    for r in results["runs"]:
        assert math.isfinite(r["val_loss"]) and math.isfinite(r["train_loss"]) and r["curve"]
        assert r["curve"][-1][0] == results["setup"]["steps"]
    assert set(results["summary"]) == set(RATIOS) and results["summary"]["3:1"]["val_minus_3to1"]["mean"] == 0
    assert results["verdict"]["best"] in RATIOS
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not installed" in out.stdout
    else:
        assert (tmp_path / "out" / "hybrid_ratio.png").stat().st_size > 0


def test_bad_arguments_give_a_one_line_usage_error(tmp_path):
    out = run("--quick", "--layers", "4", "--out", str(tmp_path))
    assert out.returncode == 2 and not out.stdout
    assert out.stderr.strip().splitlines()[-1].endswith("error: --layers must be at least 8 (7:1 needs 8 layers)")
    assert "Traceback" not in out.stderr
