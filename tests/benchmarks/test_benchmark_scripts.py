"""The benchmark scripts run end to end at toy sizes and print the tables their arguments determine (headers, and
rows by their sizes, modes or steps; the timings are not checked: machines are noisy), and their shared timing
helper (benchmarks/common.py) reports spreads and warnings right, on synthetic timings."""

import math
import subprocess
import sys
from pathlib import Path

import pytest


BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402  (benchmarks/common.py)
from common import Timing, scaling_warning, spread_cell, spread_warning, timed  # noqa: E402


TIMED = {
    "chunked_loss.py",
    "kda.py",
    "kda_cuda.py",
    "model.py",
    "optimizer_step.py",
    "muon_vs_adamw.py",
    "attn_res.py",
    "vision.py",
    "k3.py",
}

CASES = {
    "chunked_loss.py": [
        "--tokens",
        "128",
        "256",
        "--vocab",
        "512",
        "--hidden",
        "16",
        "--chunk",
        "32",
        "--repeats",
        "1",
    ],
    "k3.py": [
        "--hidden",
        "64",
        "--layers",
        "4",
        "--T",
        "64",
        "--repeats",
        "1",
        "--decode-tokens",
        "2",
        "--shard",
        "1MB",
    ],
    "kda.py": ["--T", "64", "128", "--repeats", "1", "--no-memory"],
    "kda_cuda.py": ["--smoke"],  # the CUDA section's script, on the interpreter (conftest sets TRITON_INTERPRET=1)
    "model.py": ["--T", "64", "--repeats", "1", "--decode-tokens", "2"],
    "optimizer_step.py": ["--hidden", "64", "--repeats", "1"],
    "muon_vs_adamw.py": [
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--muon-steps",
        "2",
        "--hidden",
        "32",
        "--out",
        "{tmp}/m.png",
    ],
    "qk_clip.py": ["--steps", "3", "--hidden", "32", "--out", "{tmp}/q.png"],
    "attn_res.py": [
        "--layers",
        "2",
        "--hidden",
        "32",
        "--steps",
        "3",
        "--eval-every",
        "2",
        "--batch",
        "2",
        "--seq",
        "32",
        "--block-size",
        "2",
        "--timing-rounds",
        "1",
        "--out",
        "{tmp}/ar",
    ],
    "conversion.py": ["--hidden", "128", "--layers", "2", "--experts", "4", "--vocab", "512", "--shard", "1MB"],
    "vision.py": [
        "--hidden",
        "32",
        "--layers",
        "1",
        "--heads",
        "2",
        "--intermediate",
        "64",
        "--text-hidden",
        "32",
        "--size",
        "56",
        "--images",
        "1",
        "--repeats",
        "1",
    ],
}


# the tables each script prints at CASES' arguments: (header, rows), the rows given by their leading cells (what the
# arguments determine: sizes, modes, steps) or, where every cell is a measurement, by their number
FWD_KDA = "| T | ours ms | hf chunk ms | hf loop ms | spread | vs hf chunk | vs hf loop |"  # --no-memory
CHUNK_KDA_CUDA = "| T | mode | ours ms | fla ms | spread | ours / fla time | ours MB | fla MB |"
TABLES = {
    "chunked_loss.py": [
        (
            "| tokens | vocab | hidden | dtype | chunk | plain peak MB | chunked peak MB | ratio | plain ms | chunked ms "
            "| spread | time ratio |",
            [("128", "512"), ("256", "512"), ("8192", "163840", "7168", "bfloat16", "4096"), ("8192", "163840")],
        )
    ],
    "attn_res.py": [
        (
            "| | final val loss | s/step in training | fwd+bwd s, interleaved | spread | overhead (interleaved) |",
            ["baseline", "Block AttnRes"],
        ),
        ("| sublayer | input RMS baseline | input RMS AttnRes |", ["0 (attn)", "1 (mlp)", "2 (attn)", "3 (mlp)"]),
        ("| layer | grad norm baseline | grad norm AttnRes |", ["0", "1"]),
    ],
    "conversion.py": [
        (
            "| checkpoint MB | largest tensor MB | shard MB | output shards | import-only MB | converter peak MB "
            "| peak - import-only MB |",
            1,
        )
    ],
    "k3.py": [
        ("| T | K3 ms | off ms | spread | K3 / off |", ["64"]),
        ("| K3 tokens/s | off tokens/s | spread | K3 / off time |", 1),
        (
            "| on disk MB | shards | load s | peak growth MB: allocated (RssAnon) | mapped shards (RssFile) "
            "| bf16 model + largest shard MB | allocated / budget |",
            1,
        ),
    ],
    "kda.py": [
        (FWD_KDA, ["64", "128"]),  # forward
        (FWD_KDA, ["64", "128"]),  # forward+backward
        (
            "| T | mode | plain ms | safe ms | spread | safe / plain |",
            [("64", "fwd"), ("64", "fwd+bwd"), ("128", "fwd"), ("128", "fwd+bwd")],
        ),
    ],
    "kda_cuda.py": [
        ("| dtype | impl | o | S | dq | dk | dv | dg | dbeta | dh0 |", [("float32", "ours")]),
        (CHUNK_KDA_CUDA, [("64", "fwd"), ("64", "fwd+bwd")]),  # precomputed gate
        (CHUNK_KDA_CUDA, [("64", "fwd"), ("64", "fwd+bwd")]),  # fused gate
        ("| B | ours us | fla us | spread | ours / fla time | max abs diff |", ["1"]),
    ],
    "model.py": [
        ("| T | ours ms | native ms | spread | speed-up |", ["64"]),
        ("| prompt | ours tokens/s | native tokens/s | spread | ratio |", ["128", "64"]),
        ("| prompt | eager tokens/s | compiled tokens/s | spread | speed-up |", ["128", "64"]),
        ("| T | hybrid bytes/token | all-MLA bytes/token | ratio |", ["64"]),
    ],
    "muon_vs_adamw.py": [("| step | AdamW val loss | MuonClip val loss |", ["2", "4"])],
    "optimizer_step.py": [
        (
            "| hidden | params | Muon matrices | MuonClip ms | MuonClip (bf16 NS) ms | torch Muon + AdamW ms | spread "
            "| ratio | ratio (bf16 NS) |",
            ["64"],
        )
    ],
    "qk_clip.py": [
        (
            "| step | loss (no clip) | max logit (no clip) | loss (QK-Clip) | max logit (QK-Clip) | heads clipped so far |",
            ["1", "2", "3"],
        )
    ],
    "vision.py": [("| images | ours ms | kimi_k25 ms | spread | speed-up | max abs diff |", ["1"])],
}


def markdown_tables(text: str) -> list[tuple[str, list[list[str]]]]:
    """The markdown tables in `text`: (header line, rows as lists of stripped cells). Every table has its |---|
    line and every row the header's number of cells; HTML comments between rows (a peer's failure) are skipped."""

    def cells(line):
        return [c.strip() for c in line.strip()[1:-1].split("|")]

    lines, tables, i = text.splitlines(), [], 0
    while i < len(lines):
        header = lines[i].strip()
        if not header.startswith("|"):
            i += 1
            continue
        n = len(cells(header))
        assert i + 1 < len(lines) and lines[i + 1].strip() == "|---" * n + "|", (header, lines[i + 1 : i + 2])
        rows, i = [], i + 2
        while i < len(lines) and lines[i].strip().startswith(("|", "<!--")):
            if lines[i].strip().startswith("|"):
                assert len(cells(lines[i])) == n, (header, lines[i])
                rows.append(cells(lines[i]))
            i += 1
        tables.append((header, rows))
    return tables


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_script_runs(script, tmp_path):
    args = [a.format(tmp=tmp_path) for a in CASES[script]]
    out = subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    tables = markdown_tables(out.stdout)
    assert [header for header, _ in tables] == [header for header, _ in TABLES[script]], out.stdout
    for (header, rows), (_, expected) in zip(tables, TABLES[script]):
        if isinstance(expected, int):
            assert len(rows) == expected, (header, rows)
        else:
            keys = [key if isinstance(key, tuple) else (key,) for key in expected]
            assert [tuple(row[: len(key)]) for row, key in zip(rows, keys)] == keys and len(rows) == len(keys), (
                header,
                rows,
            )
    if script in TIMED:  # the spread of the repeats is part of every timing's report
        assert "spread" in out.stdout


def test_markdown_tables_reads_headers_rows_and_refuses_ragged_ones():
    text = "# title\n| a | b |\n|---|---|\n| 1 | x |\n<!-- note -->\n| 2 | |\n\nafter\n| c |\n|---|\n"
    assert markdown_tables(text) == [("| a | b |", [["1", "x"], ["2", ""]]), ("| c |", [])]
    with pytest.raises(AssertionError):
        markdown_tables("| a | b |\n|---|---|\n| 1 |\n")  # a row short of a cell
    with pytest.raises(AssertionError):
        markdown_tables("| a | b |\n| 1 | 2 |\n")  # no |---| line


def test_timing_spread_is_the_interquartile_range_over_the_median():
    steady = Timing((0.100, 0.102, 0.098, 0.101, 0.099))
    assert steady.median == 0.100 and steady.min == 0.098 and steady.max == 0.102
    assert steady.spread == pytest.approx(0.002 / 0.100) and not steady.noisy
    assert Timing((1.0, 1.0, 1.0, 1.0, 9.0)).spread == 0  # one outlier of five: the median holds
    assert Timing((0.016, 0.720, 0.700)).spread == pytest.approx((0.710 - 0.358) / 0.700)  # three: half the range
    assert Timing((0.016, 0.720, 0.700)).noisy
    assert math.isnan(Timing((0.5,)).spread) and not Timing((0.5,)).noisy  # one repeat: unknown, not noisy
    assert math.isnan(common.NOT_RUN.median)


def test_spread_cell_and_warning_flag_only_noisy_timings():
    steady, noisy = Timing((0.10, 0.11, 0.10)), Timing((0.016, 0.72, 0.70))
    assert spread_cell(steady) == "5%" and spread_cell(steady, noisy) == "50% !"
    assert spread_cell(Timing((0.5,)), common.NOT_RUN) == "n/a"
    assert spread_warning({"ours": steady, "peer": Timing((0.2, 0.21, 0.2))}) is None
    line = spread_warning({"T=512 ours": noisy, "T=1024 ours": steady}, "forward timings")
    assert line.startswith("WARNING: 1 noisy forward timings") and "T=512 ours 50%" in line and "T=1024" not in line
    assert "quiet machine" in line and "pin threads" in line and "\n" not in line


def test_scaling_warning_catches_a_longer_input_running_faster():
    # the reported run: 720 ms at T=512, 16 ms at T=1024 (each steady on its own)
    slow, fast = Timing((0.72, 0.72, 0.73)), Timing((0.016, 0.016, 0.017))
    assert "implausible" in scaling_warning("scaling (fwd)", slow, fast, 512, 1024)
    assert "implausible" in scaling_warning("scaling (fwd)", fast, slow, 512, 2048)  # 45x for 4x longer
    assert scaling_warning("scaling (fwd)", Timing((0.1, 0.1)), Timing((0.38, 0.4)), 512, 2048) is None
    assert scaling_warning("scaling (fwd)", Timing((0.1, 0.1)), common.NOT_RUN, 512, 2048) is None


def test_timed_counts_repeats_and_keeps_three_within_a_budget():
    calls = []
    t = timed(lambda: calls.append(1), 4, warmup=2)
    assert len(t.times) == 4 and len(calls) == 6
    # every call outlasts the budget: it stops after the minimum of 3 repeats (not asserting on the times)
    import time

    t = timed(lambda: time.sleep(0.002), 50, warmup=0, budget_s=0.001)
    assert len(t.times) == 3
    assert len(timed(lambda: None, 2, budget_s=0.0).times) == 2  # fewer repeats asked than the minimum
