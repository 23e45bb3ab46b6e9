"""Helpers shared by the benchmark scripts: argument parsing, timing (with the spread of the repeats)
and PNG plots.

Every timing is a `Timing` (all repeats, not just their median): the tables print its spread, and
`spread_warning` turns a spread large enough to make the ratios built on it unreliable into a WARNING
line, instead of a silently contradictory table.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from dataclasses import dataclass


# the small hybrid model the CPU benchmarks time (benchmarks/model.py against transformers' kimi_linear,
# benchmarks/claims/long_context.py against all-MLA): 4 layers of hidden 256, the first MLP dense, then MoE; each script
# adds its layer_types and expert count
HYBRID_SIZE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    num_experts_per_tok=2,
    n_shared_experts=1,
    linear_num_heads=4,
    linear_head_dim=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=["dense"] + ["sparse"] * 3,
)

# interquartile range / median above which a timing is too noisy for the ratios built on it
NOISY_SPREAD = 0.25
QUIET_HINT = "rerun on a quiet machine or pin threads (e.g. OMP_NUM_THREADS=1 taskset -c 0 ...), with more repeats"


def argument_parser(description: str | None, **kwargs) -> argparse.ArgumentParser:
    """The script's parser. Run by `kimi-hf bench NAME`, its usage names that command (the CLI sets KIMI_HF_PROG)."""
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return argparse.ArgumentParser(prog=os.environ.get("KIMI_HF_PROG") or None, description=description, **kwargs)


@dataclass(frozen=True)
class Timing:
    """The wall times (seconds) of the repeats of one measurement."""

    times: tuple[float, ...]

    def __post_init__(self):
        object.__setattr__(self, "times", tuple(float(t) for t in self.times))

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    @property
    def min(self) -> float:
        return min(self.times, default=math.nan)

    @property
    def max(self) -> float:
        return max(self.times, default=math.nan)

    @property
    def spread(self) -> float:
        """Interquartile range / median of the repeats (nan below 2 repeats: unknown). Robust to one
        outlier among 5 repeats; with 3 it is half the range."""
        if len(self.times) < 2 or not self.median > 0:
            return math.nan
        q1, _, q3 = statistics.quantiles(self.times, n=4, method="inclusive")
        return (q3 - q1) / self.median

    @property
    def noisy(self) -> bool:
        return self.spread > NOISY_SPREAD  # False when unknown (nan)

    @property
    def ms(self) -> float:
        return self.median * 1e3

    def __str__(self) -> str:
        return f"{self.ms:.1f} ms (min {self.min * 1e3:.1f}, max {self.max * 1e3:.1f}, spread {spread_cell(self)})"


NOT_RUN = Timing(())  # a cell that was skipped: nan everywhere


def timed(fn, repeats: int, warmup: int = 1, budget_s: float | None = None, min_repeats: int = 3) -> Timing:
    """Wall times of up to `repeats` calls of fn() after `warmup` calls. With budget_s, stops once the repeats
    took that long, after at least min(min_repeats, repeats) of them: slow peers stay bounded in time and
    keep enough repeats for a spread."""
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    for i in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if budget_s is not None and i + 1 >= min(min_repeats, repeats) and time.perf_counter() - start > budget_s:
            break
    return Timing(tuple(times))


def decode_step_times(model, prompt_len: int, new_tokens: int, vocab_size: int, low: int = 3) -> Timing:
    """The time of each greedy decoding step (one token over the cache) after a random prompt of prompt_len
    tokens drawn from [low, vocab_size)."""
    import torch

    with torch.no_grad():
        x = torch.randint(low, vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
        out = model(input_ids=x, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return Timing(tuple(times))


def spread_cell(*timings: Timing) -> str:
    """The worst spread of `timings` as a table cell: '7%', '41% !' when noisy, 'n/a' when unknown."""
    spreads = [t.spread for t in timings if not math.isnan(t.spread)]
    if not spreads:
        return "n/a"
    worst = max(spreads)
    return f"{worst:.0%}" + (" !" if worst > NOISY_SPREAD else "")


def ratio_range(num: Timing, den: Timing) -> tuple[float, float, float]:
    """num / den by medians, and the lowest and highest ratio the repeats allow (min / max, max / min)."""
    return num.median / den.median, num.min / den.max, num.max / den.min


def spread_warning(timings: dict[str, Timing], what: str = "timings") -> str | None:
    """A WARNING line naming the noisy ones of `timings` (label -> Timing), or None when all are steady."""
    noisy = {label: t for label, t in timings.items() if t.noisy}
    if not noisy:
        return None
    worst = sorted(noisy.items(), key=lambda kv: -kv[1].spread)
    listed = ", ".join(f"{label} {t.spread:.0%}" for label, t in worst[:6]) + (", ..." if len(worst) > 6 else "")
    return (
        f"WARNING: {len(noisy)} noisy {what} (spread = interquartile range / median of the repeats above "
        f"{NOISY_SPREAD:.0%}: {listed}): the ratios that use them are unreliable, possibly meaningless; "
        f"{QUIET_HINT}"
    )


def scaling_warning(what: str, small: Timing, large: Timing, small_size: float, large_size: float) -> str | None:
    """For an operator linear in its size (plus a fixed cost): a WARNING line when time(large) / time(small) is
    implausible, i.e. the larger input ran clearly faster, or far slower than linear. Then the machine's load
    changed between the two measurements, which cannot be compared, however steady each one's repeats were."""
    ratio, linear = large.median / small.median, large_size / small_size
    if 0.8 <= ratio <= 3 * linear or math.isnan(ratio):
        return None
    return (
        f"WARNING: {what}: time({large_size:g}) / time({small_size:g}) = {ratio:.2f} is implausible for a "
        f"linear-time operator (expected about 1 to {linear:g}): the load changed between the two; {QUIET_HINT}"
    )


def warn(line: str | None) -> bool:
    """Prints a WARNING line (if any); True if it did."""
    if line:
        print(f"\n{line}", flush=True)
    return bool(line)


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
