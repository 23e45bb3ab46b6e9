"""Claim (Kimi Linear, arXiv 2510.26692): the 3:1 KDA : MLA hybrid decodes up to 6.3x faster (time per output
token) than the same model with MLA in every layer at 1M tokens of context, with up to 75% less cache. The issue also
quotes "2.3x at 512k" for decoding; the paper gives 2.3x (512k) and 2.9x (1M) as its *prefill* speed-ups (SPEC.md),
so that cell is marked. Our other decode benchmark (benchmarks/model.py) stops at 2048 tokens.

What this measures: per-token greedy decode time (B=1) and cache bytes against the context length T, for kimi_hf's
KimiHybridForCausalLM with Kimi Linear's 3:1 layout (3 KDA + 1 MLA layers) and the same model with 4 MLA layers, at
T = 1k, 2k, 4k, ..., 1M (2^20; --contexts goes further). Then a fit of each model's ms/token, a + b T, on
T >= 64k (relative residuals), the ratio it gives at 512k, 1M and T -> inf beside the measured one and the paper's,
and a memory-traffic estimate of the real 48B config at B=1 (all active weights + the whole cache read once per
token; not a measurement).

Setup, and why:
- The model is benchmarks/model.py's (hidden 256, 4 layers, 4 heads, kv_lora_rank 128 + rope 32, KDA 4 heads x 64,
  8 experts top-2 + 1 shared; fp32, 7.5M parameters): small enough that 1M tokens (and 2M) fit with margin. The
  all-MLA cache is 4 layers x 160 x 4 B = 2,560 B/token: 2.7 GB at 1M, 5.4 GB at 2M; with the hybrid's (a quarter of it)
  and the copies of a decode step, peak RSS is about 4.4 GB at 1M and 8-9 GB at 2M. The script prints the largest
  context the machine would hold (peak RSS extrapolated to 80% of its memory: about 4-5M tokens on 24 GiB).
- The caches are filled synthetically: decoding costs what the cache's length costs, not what its values are, and
  prefilling 1M tokens through MLA on two cores would take hours. The fill goes through the cache's own methods:
  `update` with T latent / rope-key rows for MLA layers; `update_conv_state` (in chunks, so the layer counts T tokens,
  as after a prefill) and `update_recurrent_state` for KDA layers. At T = 8192 (--quick: 256) the script first checks
  that the synthetic cache has exactly the layout a real prefill leaves (every tensor's shape and dtype, the token
  counts; it stops otherwise) and that decoding over it costs the same as over the prefilled one (a table, and a
  WARNING line beyond 25%).
- Timed: the model's real forward of one token over the cache, the two models' steps interleaved (a change in the
  machine's load hits both), after one warm-up step each; per seed (weights and cache contents) the median of the
  steps. Cells give the seeds' medians as mean ± std [min, max]; `spread` is the row's worst interquartile range /
  median of the steps, with a WARNING line when it is too large to trust.
- The fit starts at 64k: from there every MLA layer's latents (40 MB) are far past the CPU's own caches and each
  step's fresh allocations are mmap'd (page faults), so the cost per cached token is that of memory; below it is
  lower, and one line through both regimes fits neither.
- --cache dynamic (default): the package's KimiHybridCache, which generate() uses; its MLA layers grow by
  concatenation, a copy of the latents at every step. --cache static: transformers' pre-allocated StaticCache.
- At B=1 the hybrid costs a + b T (its one MLA layer) and all-MLA a' + 4 b T (four), so their ratio tends to the
  MLA layer ratio, 4 here (27 / 7 = 3.9 for the 48B config), and exceeds it only if a' > 4 a.

    kimi-hf bench claims long-context            # T = 1k .. 1M, 3 seeds, 16 tokens each: about 5 min
    kimi-hf bench claims long-context --quick    # T = 1k, 2k, 3 tokens, one seed: a smoke run (seconds)
    (or python benchmarks/claims/long_context.py ...; --contexts, --tokens, --fit-from, --cache, --threads, --out)

Full runtime on 2 idle cores: 296 s for T = 1k .. 1M and three seeds (measured, this machine, 2026-12-05); T doubles
the time of a step and of the fill, so 2M (--contexts ... 2097152) adds about twice that. The script prints each
context's seconds and its total. Writes OUT/results.json and OUT/long_context.png (default OUT:
outputs/claims/long_context).
"""

from __future__ import annotations

import gc
import math
import os
import resource
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # report.py, benchmarks/common.py (report.py adds the checkout)

from common import HYBRID_SIZE, QUIET_HINT, Timing, spread_cell, spread_warning, warn  # noqa: E402
from report import (  # noqa: E402
    cell,
    claim_parser,
    positive_int,
    print_table,
    save_plot,
    seeds_of,
    spread,
    write_results,
)


FULL_CONTEXTS = [2**k for k in range(10, 21)]  # 1k .. 1M: the paper's 1M point measured, not extrapolated
QUICK_CONTEXTS = [1024, 2048]

# benchmarks/model.py's model (layer_types set per model below)
SIZE = dict(HYBRID_SIZE, num_experts=8, linear_conv_kernel_dim=4)

# the paper's decode speed-ups of Kimi Linear over MLA (time per output token), by context length
PAPER = {2**19: "2.3x*", 2**20: "6.3x"}
PAPER_NOTE = (
    "* the issue's number; the paper (SPEC.md) gives 2.3x at 512k and 2.9x at 1M as prefill speed-ups, and 6.3x at "
    "1M for decoding"
)
ACTIVE_PARAMS_48B = 3e9  # Kimi-Linear-48B-A3B: about 3B parameters read per token (SPEC.md), bf16 in the estimate
CONV_FILL_CHUNK = 4096  # tokens per update_conv_state call of the synthetic fill
# the fit a + b T uses T >= this: there every MLA layer's latents (40 MB at 64k) are far past the CPU's own caches
# and the step's fresh allocations are mmap'd, so the cost per cached token is that of memory (below, it is lower)
FIT_FROM = 65536
RAM_SHARE = 0.8  # "holds": the measured peak RSS, extrapolated linearly, under this share of the machine's memory


def parse_args(argv=None):
    p = claim_parser("long_context", __doc__)
    p.add_argument(
        "--contexts", type=positive_int, nargs="+", help="context lengths T (default 1k..1M; --quick 1k, 2k)"
    )
    p.add_argument("--fit-from", type=positive_int, default=FIT_FROM, help=f"fit a + b T on T >= this ({FIT_FROM})")
    p.add_argument(
        "--tokens", type=positive_int, default=None, help="timed decode steps per model, seed, T (16; --quick 3)"
    )
    p.add_argument(
        "--check-context", type=positive_int, default=None, help="T of the prefill check (8192; --quick 256)"
    )
    p.add_argument("--cache", choices=["dynamic", "static"], default="dynamic", help="KimiHybridCache or StaticCache")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    args.contexts = sorted(set(args.contexts or (QUICK_CONTEXTS if args.quick else FULL_CONTEXTS)))
    args.tokens = args.tokens or (3 if args.quick else 16)
    args.check_context = args.check_context or (256 if args.quick else 8192)
    return args


# --------------------------------------------------------------------------------------------------- models, caches
def build_models(seed: int):
    """(hybrid, all-MLA): the same size, Kimi Linear's 3:1 layout vs MLA in every layer, weights from `seed`."""
    import torch

    from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig
    from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types

    n = SIZE["num_hidden_layers"]
    out = []
    for types in (kimi_linear_layer_types(n), ["full_attention"] * n):
        torch.manual_seed(seed)
        out.append(KimiHybridForCausalLM(KimiHybridTextConfig(**SIZE, layer_types=types)).eval())
    return tuple(out)


def new_cache(model, kind: str, max_len: int):
    from transformers import StaticCache

    from kimi_hf import KimiHybridCache

    if kind == "static":
        return StaticCache(config=model.config, max_cache_len=max_len)
    return KimiHybridCache(config=model.config)


def cache_bytes(cache) -> int:
    """Bytes of every cached tensor: KimiHybridCache.nbytes, which reads only the layers' tensors, so it counts a
    StaticCache too (its pre-allocated length)."""
    from kimi_hf import KimiHybridCache

    return KimiHybridCache.nbytes(cache)


def synthetic_fill(model, cache, T: int, seed: int):
    """Puts T tokens' worth of state in an empty cache through its own methods, as a prefill of T tokens would: per
    MLA layer T latent rows [1, 1, T, kv_lora_rank] (unit RMS, as kv_a_layernorm leaves them) and rope-key rows
    [1, 1, T, rope] (`update`); per KDA layer the q/k/v conv inputs (`update_conv_state`, in chunks: the layer counts
    T tokens and keeps the last kernel - 1) and an fp32 recurrent state [1, H, K, V] (`update_recurrent_state`).
    Values are random: decode cost does not depend on them."""
    import torch

    c = model.config
    g = torch.Generator().manual_seed(seed)
    width = 3 * c.linear_num_heads * c.linear_head_dim
    chunk = torch.randn(1, width, min(T, CONV_FILL_CHUNK), generator=g)
    for i, kind in enumerate(c.layer_types):
        if kind == "full_attention":
            latent = torch.randn(1, 1, T, c.kv_lora_rank, generator=g)
            k_rope = torch.randn(1, 1, T, c.qk_rope_head_dim, generator=g)
            cache.update(latent, k_rope, i)
            del latent, k_rope
        else:
            done = 0
            while done < T:
                n = min(chunk.shape[-1], T - done)
                cache.update_conv_state(chunk[..., :n], i, conv_kernel_size=c.linear_conv_kernel_dim - 1)
                done += n
            H, K = c.linear_num_heads, c.linear_head_dim
            state = 0.05 * torch.randn(1, H, K, K, generator=g, dtype=torch.float32)
            cache.update_recurrent_state(state, i)
    return cache


def prefill(model, cache, T: int, seed: int):
    """A real prefill: the model's forward over T random tokens into the cache; returns the next token."""
    import torch

    x = torch.randint(3, SIZE["vocab_size"], (1, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = model(input_ids=x, past_key_values=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


def layout(cache) -> list[tuple]:
    """What a cache holds, without the values: per layer its class, every tensor's shape and dtype, its token
    counts; and the cache's own length."""
    import torch

    def desc(t):
        return (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else None

    out = []
    for layer in cache.layers:
        entry = [type(layer).__name__]
        if hasattr(layer, "conv_states"):
            entry += [
                [desc(t) for t in layer.conv_states.values()],
                [desc(t) for t in layer.recurrent_states.values()],
                dict(layer.has_previous_state),
                dict(layer.conv_kernel_size),
                int(layer.cumulative_length_linear),
            ]
        else:
            entry += [desc(getattr(layer, "keys", None)), desc(getattr(layer, "values", None))]
            entry.append(int(layer.get_seq_length()))
        out.append(tuple(str(e) for e in entry))
    out.append(("seq_length", str(int(cache.get_seq_length()))))
    return out


def decode_step(model, cache, tok):
    """One greedy token over the cache (the model's real forward); returns the next token."""
    import torch

    with torch.no_grad():
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


def interleaved_steps(runs, tokens: int, warmup: int = 1):
    """runs: [(model, cache, first token)]; `warmup` untimed steps each, then `tokens` rounds of one step each, in
    turn. Returns one Timing per run."""
    toks = [tok for _, _, tok in runs]
    times = [[] for _ in runs]
    for r in range(warmup + tokens):
        for i, (model, cache, _) in enumerate(runs):
            t0 = time.perf_counter()
            toks[i] = decode_step(model, cache, toks[i])
            if r >= warmup:
                times[i].append(time.perf_counter() - t0)
    return [Timing(tuple(t)) for t in times]


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


# ------------------------------------------------------------------------------------------------------ analysis
def fit_line(points):
    """a, b of y = a + b x minimising the relative residuals sum(((y - a - b x) / y)^2); points: [(x, y)]."""
    w = [1.0 / y**2 for _, y in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * y for wi, (_, y) in zip(w, points))
    sxy = sum(wi * x * y for wi, (x, y) in zip(w, points))
    det = sw * sxx - sx * sx
    if len({x for x, _ in points}) < 2 or det == 0:
        return math.nan, math.nan
    return (sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det


def traffic_estimate_48b(T: float) -> tuple[float, float]:
    """Bytes read per decoded token at B=1 by Kimi-Linear-48B (the package's default config) and by the same model
    with MLA in all 27 layers: the active weights in bf16 plus the whole cache (latents in bf16, KDA's recurrent state
    in fp32, its conv inputs in bf16). Returns (hybrid, all-MLA)."""
    from kimi_hf import KimiHybridTextConfig

    c = KimiHybridTextConfig()
    n_mla = c.layer_types.count("full_attention")
    n_kda = c.num_hidden_layers - n_mla
    latent = (c.kv_lora_rank + c.qk_rope_head_dim) * 2  # B per token per MLA layer
    d = c.linear_num_heads * c.linear_head_dim
    kda_state = c.linear_num_heads * c.linear_head_dim**2 * 4 + 3 * d * (c.linear_conv_kernel_dim - 1) * 2
    weights = ACTIVE_PARAMS_48B * 2
    return weights + n_mla * latent * T + n_kda * kda_state, weights + c.num_hidden_layers * latent * T


def total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def largest_context(results, fit_from: int) -> int | None:
    """The T whose peak RSS, extrapolated linearly from the two largest contexts measured, reaches RAM_SHARE of the
    machine's memory (None unless both are at least fit_from: below, the caches do not dominate the memory)."""
    if len(results) < 2 or results[-2]["T"] < fit_from:
        return None
    (t0, m0), (t1, m1) = ((r["T"], r["peak_rss_gb"] * 2**30) for r in results[-2:])
    slope = (m1 - m0) / (t1 - t0)
    return int(t1 + (RAM_SHARE * total_ram() - m1) / slope) if slope > 0 else None


def label_approx(T: int) -> str:
    return f"{T / 2**20:.1f}M" if T >= 2**20 else f"{T / 2**10:.0f}k"


def label(T: int) -> str:
    if T >= 2**20 and T % 2**20 == 0:
        return f"{T // 2**20}M"
    return f"{T // 2**10}k" if T % 2**10 == 0 else str(T)


# ---------------------------------------------------------------------------------------------------------- main
def run_check(args, models, seed: int):
    """A real prefill of check_context tokens vs the synthetic fill: the same layout (else SystemExit), and decode
    steps over both, interleaved."""
    T, rows, timings, result = args.check_context, [], {}, []
    check_tokens = args.tokens if args.quick else max(8, args.tokens)
    for name, model in zip(("hybrid", "all-MLA"), models):
        max_len = T + check_tokens + 2  # a StaticCache: the prompt, a warm-up step, the timed ones
        real = new_cache(model, args.cache, max_len)
        tok = prefill(model, real, T, seed)
        synth = synthetic_fill(model, new_cache(model, args.cache, max_len), T, seed)
        same = layout(real) == layout(synth)
        if not same:
            raise SystemExit(
                f"the synthetic {name} cache differs from a prefilled one at T={T}:\n"
                f"prefill:   {layout(real)}\nsynthetic: {layout(synth)}"
            )
        nbytes = cache_bytes(synth)  # T tokens, before decoding (the same tensors' bytes as the prefilled cache)
        t_real, t_synth = interleaved_steps([(model, real, tok), (model, synth, tok)], check_tokens)
        timings.update({f"{name} prefilled": t_real, f"{name} synthetic": t_synth})
        rows.append(
            [
                name,
                T,
                f"{t_real.ms:.2f}",
                f"{t_synth.ms:.2f}",
                spread_cell(t_real, t_synth),
                f"{t_synth.median / t_real.median:.2f}",
                "yes",
            ]
        )
        result.append(
            {
                "model": name,
                "T": T,
                "prefilled_ms": t_real.ms,
                "synthetic_ms": t_synth.ms,
                "same_layout": same,
                "bytes": nbytes,
            }
        )
    print_table(
        f"Synthetic cache vs a real prefill (T={T}, seed {seed}, {check_tokens} tokens)",
        ["model", "T", "prefilled ms/token", "synthetic ms/token", "spread", "synthetic / prefilled", "same layout"],
        rows,
    )
    warn(spread_warning(timings, "check timings"))
    off = [f"{r['model']} {r['synthetic_ms'] / r['prefilled_ms']:.2f}" for r in result]
    if any(not 0.8 <= r["synthetic_ms"] / r["prefilled_ms"] <= 1.25 for r in result):
        warn(
            f"WARNING: decoding over the synthetic cache and over the prefilled one differ by more than 25% "
            f"(synthetic / prefilled: {', '.join(off)}): the machine's load changed, or the synthetic cache is not "
            f"what a prefill leaves; {QUIET_HINT}"
        )
    return result


def measure(args, models, seeds):
    """Per context length: both models' decode steps over synthetic caches of T tokens, per seed. Returns the
    result rows (dicts) and every Timing by label."""
    import torch

    results, all_timings = [], {}
    for T in args.contexts:
        t0 = time.perf_counter()
        row = {"T": T, "hybrid_ms": [], "mla_ms": [], "ratio": []}
        for seed in seeds:
            hybrid, mla = models[seed]
            caches = [
                synthetic_fill(m, new_cache(m, args.cache, T + args.tokens + 2), T, seed * 7919 + T)
                for m in (hybrid, mla)
            ]
            row["hybrid_bytes"], row["mla_bytes"] = (cache_bytes(c) for c in caches)  # T tokens, before decoding
            first = torch.tensor([[3]])
            t_h, t_m = interleaved_steps([(hybrid, caches[0], first), (mla, caches[1], first)], args.tokens)
            del caches
            gc.collect()
            row["hybrid_ms"].append(t_h.ms)
            row["mla_ms"].append(t_m.ms)
            row["ratio"].append(t_m.median / t_h.median)
            all_timings.update({f"T={label(T)} seed {seed} hybrid": t_h, f"T={label(T)} seed {seed} all-MLA": t_m})
        timings = [t for key, t in all_timings.items() if key.startswith(f"T={label(T)} ")]
        row.update(
            cache_ratio=row["hybrid_bytes"] / row["mla_bytes"],
            spread=max((t.spread for t in timings if not math.isnan(t.spread)), default=math.nan),
            spread_cell=spread_cell(*timings),
            peak_rss_gb=peak_rss_gb(),
            seconds=time.perf_counter() - t0,
        )
        results.append(row)
        print(f"# T={label(T)}: {row['seconds']:.0f} s", flush=True)
    return results, all_timings


def fit(results, fit_from: int):
    """ms/token = a + b T per model on the rows with T >= fit_from (all rows when fewer than two such T)."""
    rows = [r for r in results if r["T"] >= fit_from]
    rows = rows if len(rows) >= 2 else results
    fits = {}
    for key, name in (("hybrid_ms", "hybrid"), ("mla_ms", "all-MLA")):
        a, b = fit_line([(r["T"], ms) for r in rows for ms in r[key]])
        means = [(r["T"], spread(r[key])["mean"]) for r in rows]
        worst = max(abs(a + b * T - y) / y for T, y in means)
        fits[name] = {"a_ms": a, "b_ms_per_token": b, "max_rel_residual": worst, "contexts": [r["T"] for r in rows]}
    return fits


def fitted_ratio(fits, T: float) -> float:
    h, m = fits["hybrid"], fits["all-MLA"]
    if math.isinf(T):
        return m["b_ms_per_token"] / h["b_ms_per_token"] if h["b_ms_per_token"] else math.nan
    return (m["a_ms"] + m["b_ms_per_token"] * T) / (h["a_ms"] + h["b_ms_per_token"] * T)


def extrapolate(results, fits) -> list[dict]:
    """At 512k, 1M and T -> inf: the paper's decode ratio, ours measured (where measured), ours from the fit, and
    the 48B memory-traffic estimate."""
    measured = {r["T"]: r["ratio"] for r in results}
    out = []
    for T in (2**19, 2**20, math.inf):
        hyb_bytes, mla_bytes = traffic_estimate_48b(T) if not math.isinf(T) else (7, 27)  # limit: MLA layers
        out.append(
            {
                "T": None if math.isinf(T) else T,
                "paper": PAPER.get(T),
                "measured": measured.get(T),
                "fit": fitted_ratio(fits, T),
                "traffic_48b": mla_bytes / hyb_bytes,
            }
        )
    return out


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    seeds = seeds_of(args)
    models = {seed: build_models(seed) for seed in seeds}
    n_params = sum(p.numel() for p in models[seeds[0]][0].parameters())
    print(
        f"# long-context decoding: torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, B=1, "
        f"{args.cache} cache; hybrid 3 KDA + 1 MLA vs 4 MLA layers ({n_params / 1e6:.1f}M params each); "
        f"T = {', '.join(label(T) for T in args.contexts)}; seeds {seeds}; {args.tokens} timed tokens each"
    )
    if args.quick:
        print("# --quick: a smoke run that checks the script, not the claim (two short contexts, three tokens)")
    check = run_check(args, models[seeds[0]], seeds[0])

    results, all_timings = measure(args, models, seeds)
    print_table(
        f"Decode time and cache against context length ({len(seeds)} seed(s): mean ± std [min, max] of per-seed "
        "medians; MB = 2^20 bytes)",
        [
            "T",
            "hybrid ms/token",
            "all-MLA ms/token",
            "spread",
            "all-MLA / hybrid time",
            "hybrid cache MB",
            "all-MLA cache MB",
            "hybrid / all-MLA cache",
            "peak RSS GB",
        ],
        [
            [
                r["T"],
                cell(r["hybrid_ms"], 2),
                cell(r["mla_ms"], 2),
                r["spread_cell"],
                cell(r["ratio"], 2),
                f"{r['hybrid_bytes'] / 2**20:.3f}",
                f"{r['mla_bytes'] / 2**20:.3f}",
                f"{r['cache_ratio']:.3f}",
                f"{r['peak_rss_gb']:.2f}",
            ]
            for r in results
        ],
    )
    warn(spread_warning(all_timings, "decode timings"))

    fits = fit(results, args.fit_from)
    span = fits["hybrid"]["contexts"]
    print_table(
        f"Fit of ms/token = a + b T on T = {label(span[0])}..{label(span[-1])} (relative residuals, all seeds' medians; "
        "a: that range's intercept, not the cost at T = 0)",
        ["model", "a ms", "b ms per 100k tokens", "max rel. residual"],
        [
            [name, f"{f['a_ms']:.2f}", f"{f['b_ms_per_token'] * 1e5:.3f}", f"{f['max_rel_residual']:.0%}"]
            for name, f in fits.items()
        ],
    )
    print(f"\nb(all-MLA) / b(hybrid) = {fitted_ratio(fits, math.inf):.2f} (MLA layers: 4 vs 1)")

    extrapolation = extrapolate(results, fits)
    print_table(
        "All-MLA / hybrid decode time at long context: the paper, ours, a memory-traffic estimate",
        ["T", "paper", "ours measured", "ours fit", "48B memory-traffic estimate (B=1)"],
        [
            [
                "inf" if e["T"] is None else e["T"],
                e["paper"] or "-",
                "-" if e["measured"] is None else cell(e["measured"], 2) + "x",
                f"{e['fit']:.2f}x",
                f"{e['traffic_48b']:.2f}x",
            ]
            for e in extrapolation
        ],
    )
    print(
        f"\n{PAPER_NOTE}.\nOurs fit: from the fit above, an extrapolation beyond the largest T measured "
        f"({label(args.contexts[-1])}). The memory-traffic estimate assumes every active weight (3B, bf16) and the "
        "whole cache are read once per token (not a measurement). At B=1 both tend to the MLA layer ratio (4 here, "
        "27/7 for the 48B config)."
    )
    holds = largest_context(results, args.fit_from)
    if holds:
        print(
            f"\nThe largest context this machine holds for both models at once: about {label_approx(holds)} tokens "
            f"(peak RSS of the two largest T, extrapolated linearly, under {RAM_SHARE:.0%} of "
            f"{total_ram() / 2**30:.0f} GiB)."
        )

    elapsed = time.perf_counter() - started
    print(f"\n# total {elapsed:.0f} s")
    setup = {
        "model": {k: v for k, v in SIZE.items() if k != "mlp_layer_types"},
        "hybrid_layer_types": list(models[seeds[0]][0].config.layer_types),
        "params": n_params,
        "cache": args.cache,
        "contexts": args.contexts,
        "tokens": args.tokens,
        "seeds": seeds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "quick": args.quick,
    }
    payload = {
        "claim": "long-context",
        "setup": setup,
        "check": check,
        "rows": results,
        "fits": fits,
        "extrapolation": extrapolation,
        "paper_note": PAPER_NOTE,
        "largest_context_estimate": holds,
        "elapsed_s": elapsed,
    }
    print(f"results: {write_results(args.out, payload)}")
    save_plot(os.path.join(args.out, "long_context.png"), lambda fig: draw(fig, results, fits), figsize=(11, 4.5))


def draw(fig, results, fits):
    Ts = [r["T"] for r in results]
    top = max(20, math.ceil(math.log2(max(Ts))))  # to 1M at least
    start = min(fits["hybrid"]["contexts"])  # the fit's range and beyond
    grid = [2 ** (k / 4) for k in range(math.ceil(4 * math.log2(start)), 4 * top + 1)]
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for key, name, color in (("hybrid_ms", "hybrid (3 KDA : 1 MLA)", "C0"), ("mla_ms", "all-MLA", "C1")):
        s = [spread(r[key]) for r in results]
        mean = [x["mean"] for x in s]
        err = [[x["mean"] - x["min"] for x in s], [x["max"] - x["mean"] for x in s]]
        left.errorbar(Ts, mean, yerr=err, fmt="o-", color=color, label=name, capsize=3)
        f = fits["hybrid" if key == "hybrid_ms" else "all-MLA"]
        left.plot(grid, [f["a_ms"] + f["b_ms_per_token"] * T for T in grid], "--", color=color, alpha=0.6)
    left.set(xscale="log", yscale="log", xlabel="context T (tokens)", ylabel="ms / token (B=1)")
    left.set_title("decode time per token (dashed: fit a + bT)")
    left.legend()
    ratio = [spread(r["ratio"]) for r in results]
    right.errorbar(
        Ts,
        [x["mean"] for x in ratio],
        yerr=[[x["mean"] - x["min"] for x in ratio], [x["max"] - x["mean"] for x in ratio]],
        fmt="o-",
        color="C2",
        capsize=3,
        label="decode time, all-MLA / hybrid",
    )
    h, m = fits["hybrid"], fits["all-MLA"]
    right.plot(
        grid,
        [(m["a_ms"] + m["b_ms_per_token"] * T) / (h["a_ms"] + h["b_ms_per_token"] * T) for T in grid],
        "--",
        color="C2",
        alpha=0.6,
        label="fit, extrapolated",
    )
    right.plot(
        Ts, [r["mla_bytes"] / r["hybrid_bytes"] for r in results], "s-", color="C4", label="cache, all-MLA / hybrid"
    )
    right.plot([2**20], [6.3], "r*", markersize=12, label="paper: 6.3x decode at 1M")
    right.axhline(4, color="grey", lw=0.8, ls=":", label="MLA layer ratio (4)")
    right.set(xscale="log", xlabel="context T (tokens)", ylabel="ratio")
    right.set_ylim(bottom=0)
    right.set_title("all-MLA / hybrid")
    right.legend(fontsize=8)


if __name__ == "__main__":
    main()
