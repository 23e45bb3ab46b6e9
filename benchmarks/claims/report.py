"""Shared by the claim scripts (`benchmarks/claims/NAME.py`, run as `kimi-hf bench claims NAME [--quick]`): the
command line, the seeds' spread as a table cell, the markdown table, the results file and the plot.

    from report import claim_parser, print_table, save_plot, write_results   # benchmarks/claims/report.py

    p = claim_parser("recall", __doc__)            # --quick, --seeds, --out
    args = p.parse_args()
    ...
    print_table("MQAR accuracy", ["model", "T=256", "T=512"], rows)
    write_results(args.out, {"setup": {...}, "rows": [...]})       # OUT/results.json, never half written
    save_plot(os.path.join(args.out, "recall.png"), draw)            # benchmarks/common.py (matplotlib)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys


BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)  # benchmarks/common.py (argument_parser, save_plot)
sys.path.insert(0, os.path.dirname(BENCH))  # the checkout's kimi_hf

from common import argument_parser, save_plot  # noqa: E402


def claim_parser(name: str, description: str | None, seeds: int = 3):
    """The claim's parser: --quick (CI's smoke: a few steps, a well-formed table), --seeds S [S ...] (default
    0..seeds-1; --quick: 0 only), --out DIR (default outputs/claims/NAME)."""
    p = argument_parser(description)
    p.add_argument("--quick", action="store_true", help="a few steps: checks the script, not the claim")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help=f"default: 0..{seeds - 1} (--quick: 0)")
    p.add_argument("--out", default=os.path.join("outputs", "claims", name), help="results.json and the plot")
    p.set_defaults(_default_seeds=list(range(seeds)))
    return p


def positive_int(text: str) -> int:
    """argparse type of a count (steps, lengths, workers): an integer above 0; argparse names the flag in the error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def seeds_of(args) -> list[int]:
    if args.seeds is not None:
        return list(args.seeds)
    return [0] if args.quick else list(args._default_seeds)


def spread(values) -> dict:
    """{"mean", "std", "min", "max", "n"} of a list of numbers (std 0 for one value)."""
    values = [float(v) for v in values]
    if not values:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "min": min(values), "max": max(values), "n": len(values)}


def cell(values, digits: int = 3) -> str:
    """A table cell of several seeds' values: `mean ± std [min, max]`; one value alone: the value."""
    s = spread(values)
    if s["n"] == 0:
        return "-"
    if s["n"] == 1:
        return f"{s['mean']:.{digits}f}"
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    """A markdown table with a bold title line; every row as long as the headers (ValueError otherwise)."""
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"table {title!r}: row {row!r} has {len(row)} cells for {len(headers)} headers")
    print(f"\n**{title}**\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    sys.stdout.flush()


def write_results(out_dir: str, payload: dict) -> str:
    """OUT/results.json (indented, mode 0644 under umask 022), written to a temporary file and renamed."""
    from kimi_hf.atomic_io import atomic_write

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.json")
    return atomic_write(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


__all__ = ["cell", "claim_parser", "positive_int", "print_table", "save_plot", "seeds_of", "spread", "write_results"]
