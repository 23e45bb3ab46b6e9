"""Helpers shared by the benchmark scripts: timing and PNG plots."""

from __future__ import annotations

import os
import statistics
import time


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def save_plot(out: str, draw, figsize=(6.4, 4.8)) -> None:
    """Calls draw(fig) on a new matplotlib figure and saves it as out (PNG); says so when
    matplotlib is missing (pip install kimi-hf[bench])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig = plt.figure(figsize=figsize)
    draw(fig)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot: {out}")
