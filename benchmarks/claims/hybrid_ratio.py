"""The hybrid ratio: KDA : MLA = 0:1 (all MLA), 1:1, 3:1, 7:1 and 1:0 (all KDA), at equal parameters and steps.

The claim (Kimi Linear, arXiv 2510.26692, its hybrid-ratio ablation): 3:1 KDA : MLA is the best ratio, train / val
perplexity 9.23 / 5.65, against 9.45 / 5.77 for all-MLA (0:1), 9.29 / 5.66 at 1:1 and 9.23 / 5.70 at 7:1 (the paper
also has 15:1, which 8 layers cannot express; all-KDA, 1:0, is added here). Those are token-level perplexities of
models far larger, trained on far more tokens; this script asks the same question at the size two CPU cores train
in under an hour, and prints whatever it finds.

Setup (the full setting, the defaults):
- data: the Python standard library's sources as bytes (kimi_hf.data.ByteCorpus, 4 MB, offline), the last 5% held
  out for validation (other files than the training ones); windows of 256 bytes, batch 8 (2,048 bytes a step); seed
  s reads the training batches (s, step), the same windows in the same order for every ratio;
- models: KimiHybridForCausalLM, 8 layers, hidden 128, dense SwiGLU MLPs of width 256 (no MoE), byte vocabulary
  (259), fp32. KDA: 4 heads of 32, short convolutions of 4 (the package's torch KDA path: gates, decays and states in
  fp32). MLA (Kimi Linear's: no positional encoding): 4 heads, q/k head 32 + 16 (nope + "rope", as 128 + 64 in Kimi
  Linear), v head 32, and kv_lora_rank, the one MLA dimension without a KDA counterpart, set so that an MLA layer
  holds as many parameters as a KDA layer: 107, i.e. 84,203 against 84,132 (computed by `matched_kv_lora_rank` for
  any --hidden). Every ratio has the same MLPs, embeddings and head; the totals (1.528 M) differ by 71 parameters
  an MLA layer, at most 568 (0:1 against 1:0, 0.04%). The first table prints each model's count;
- placement as Kimi Linear's: at r:1 MLA at every (r+1)-th layer (1-based) and at the last one, KDA elsewhere.
  8 layers: 1:1 = KMKMKMKM, 3:1 = KKKMKKKM (the package's `kimi_linear_layer_types`), 7:1 = KKKKKKKM;
- training, the same for every ratio: the package's MuonClip (Muon for the hidden matrices, AdamW for the rest,
  QK-Clip tau 100 on the MLA layers), lr 1e-2, weight decay 0.1, 5% linear warm-up then cosine to 0, 500 steps
  (1.02 M bytes, a quarter of a pass over the 3.8 MB of training text), no gradient clipping, no dropout; seeds 0,
  1, 2 (initial weights and data order). lr 1e-2 is MuonClip's pick on this corpus in docs/benchmarks.md; a check at
  100 steps on all-MLA (the ratio furthest from that sweep's 2 KDA + 1 MLA model) gave val 2.424 / 2.427 / 2.593
  nats/byte at lr 3e-3 / 1e-2 / 3e-2, so all-MLA's slow start is not its learning rate;
- metrics in nats per byte (the next byte's mean cross-entropy): the validation loss on 32 fixed held-out batches
  (65,536 bytes, the same for every model), its bits per byte (nats / ln 2) and per-byte perplexity exp(nats)
  beside it; the train loss is the mean over the last 10% of the steps. The curve evaluates the first 8 of those
  batches every 50 steps. Per ratio: mean ± std [min, max] over the seeds, and each ratio's validation loss minus
  3:1's on the same seed (the paired difference: same data, less noisy than the spread).

Commands:
    kimi-hf bench claims hybrid-ratio                 # the full setting: 5 ratios x 3 seeds, 500 steps each
    kimi-hf bench claims hybrid-ratio --quick         # CI's smoke: hidden 32, 4 steps, seed 0 (checks the script)
    python benchmarks/claims/hybrid_ratio.py --seeds 0 1 2 3 4 --steps 1000 --jobs 4 --out /tmp/hr

Runs go to --jobs worker processes of one thread each (default 2; --quick 1, in this process), slowest first.
Full setting on 2 idle cores: about 36-46 minutes (the full run of 2026-12-05: 4,314 CPU s in the runs). Measured
single-threaded (CPU seconds a training step, then an evaluation batch): 0:1 0.42 / 0.11, 1:1 0.64 / 0.18, 3:1 0.74 /
0.23, 7:1 0.80 / 0.25, 1:0 0.87 / 0.26 (KDA's torch path costs about twice MLA's at 256 bytes); a seed's five runs
then take about 1,850 CPU s (500 steps and 112 evaluation batches each; 100-step runs measured 104 / 90 / 46 CPU s for
1:0 / 3:1 / 0:1 against 100 / 85 / 47 predicted), three seeds 5,550 CPU s, i.e. about 46 minutes on two workers.
Writes OUT/results.json and OUT/hybrid_ratio.png (validation curves per ratio, mean over seeds with the min-max band;
final validation loss, mean ± std and each seed).

Does 3:1 win at this scale? The script prints its verdict from the data: the ratio with the lowest mean validation
loss, and in how many seeds 3:1 beats each other ratio. Calibration at 100 steps, seed 0 only (not the result):
1:0 1.648, 3:1 1.675, 0:1 2.427 nats/byte: all-MLA, which has no positional encoding here (Kimi Linear's MLA
leaves positions to KDA), starts far slower; whether 3:1 passes all-KDA by step 500 is what the full run says.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time


sys.modules.setdefault("fla", None)  # the package's own KDA path on CPU (fla's Triton kernels need a GPU)

import torch  # noqa: E402
from report import cell, claim_parser, print_table, save_plot, seeds_of, spread, write_results  # noqa: E402

from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig  # noqa: E402
from kimi_hf.data import BOS_ID, EOS_ID, PAD_ID, ByteCorpus  # noqa: E402
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types  # noqa: E402
from kimi_hf.optim import MuonClip  # noqa: E402


# KDA : MLA -> r (KDA layers per MLA layer); None: no MLA layer at all
RATIOS = {"0:1": 0, "1:1": 1, "3:1": 3, "7:1": 7, "1:0": None}
REFERENCE = "3:1"
# Kimi Linear's hybrid-ratio ablation: (train perplexity, validation perplexity), token level
PAPER = {"0:1": (9.45, 5.77), "1:1": (9.29, 5.66), "3:1": (9.23, 5.65), "7:1": (9.23, 5.70), "1:0": None}
HEADS = 4
VAL_BATCHES, CURVE_BATCHES = 32, 8
FULL = dict(steps=500, hidden=128, layers=8, batch=8, seq=256, lr=1e-2, eval_every=50, corpus_bytes=4_000_000)
QUICK = dict(steps=4, hidden=32, layers=8, batch=2, seq=32, lr=1e-2, eval_every=2, corpus_bytes=200_000)
QUICK_VAL_BATCHES = 2


def layer_types(ratio: str, layers: int) -> list[str]:
    """Kimi Linear's placement: at r:1, MLA ("full_attention") at every (r+1)-th layer (1-based) and at the last."""
    r = RATIOS[ratio]
    if r is None:
        return ["linear_attention"] * layers
    return [
        "full_attention" if (i + 1) % (r + 1) == 0 or i == layers - 1 else "linear_attention" for i in range(layers)
    ]


def pattern(types: list[str]) -> str:
    return "".join("M" if t == "full_attention" else "K" for t in types)


def config(opts: dict, types: list[str], kv_lora_rank: int) -> KimiHybridTextConfig:
    h, head = opts["hidden"], opts["hidden"] // HEADS
    return KimiHybridTextConfig(
        vocab_size=259,
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h,
        num_hidden_layers=len(types),
        layer_types=types,
        mlp_layer_types=["dense"] * len(types),
        num_attention_heads=HEADS,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=head,
        qk_rope_head_dim=head // 2,
        v_head_dim=head,
        num_experts=4,  # unused: every MLP is dense
        num_experts_per_tok=2,
        linear_num_heads=HEADS,
        linear_head_dim=head,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        use_cache=False,
    )


def mixer_params(opts: dict, kv_lora_rank: int) -> tuple[int, int]:
    """(KDA layer, MLA layer) token-mixer parameter counts, counted on the meta device."""
    with torch.device("meta"):
        model = KimiHybridForCausalLM(config(opts, ["linear_attention", "full_attention"], kv_lora_rank))
    return tuple(sum(p.numel() for p in layer.self_attn.parameters()) for layer in model.model.layers)


def matched_kv_lora_rank(opts: dict) -> int:
    """The kv_lora_rank whose MLA layer is closest in size to a KDA layer (the count is linear in the rank)."""
    kda, at_1 = mixer_params(opts, 1)
    per_rank = mixer_params(opts, 2)[1] - at_1
    best = max(1, round((kda - at_1) / per_rank) + 1)
    return min((r for r in (best - 1, best, best + 1) if r >= 1), key=lambda r: abs(mixer_params(opts, r)[1] - kda))


_CORPUS = {}


def corpus_of(max_bytes: int) -> ByteCorpus:
    if max_bytes not in _CORPUS:
        _CORPUS[max_bytes] = ByteCorpus(max_bytes=max_bytes)
    return _CORPUS[max_bytes]


@torch.no_grad()
def val_loss(model, batches) -> float:
    model.eval()
    loss = statistics.fmean(model(input_ids=x, labels=x).loss.item() for x in batches)
    model.train()
    return loss


def train_one(ratio: str, seed: int, opts: dict) -> dict:
    """Trains the ratio's model on seed `seed`; its curve, final losses (nats / byte) and times."""
    torch.set_num_threads(opts["threads"])
    torch.set_flush_denormal(True)
    cpu0 = time.process_time()
    corpus = corpus_of(opts["corpus_bytes"])
    val = [corpus.batch(i, opts["batch"], opts["seq"], split="val") for i in range(opts["val_batches"])]
    torch.manual_seed(seed)
    model = KimiHybridForCausalLM(config(opts, layer_types(ratio, opts["layers"]), opts["kv_lora_rank"])).train()
    steps = opts["steps"]
    opt = MuonClip.from_model(model, lr=opts["lr"], weight_decay=0.1, qk_clip_tau=100.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    curve, losses, times = [], [], []
    for step in range(1, steps + 1):
        x = corpus.batch(step, opts["batch"], opts["seq"], seed=seed)
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise RuntimeError(f"{ratio} seed {seed}: the training loss is {losses[-1]} at step {step}")
        if step % opts["eval_every"] == 0 or step == steps:
            curve.append((step, val_loss(model, val[: opts["curve_batches"]])))
    tail = losses[-max(1, steps // 10) :]
    return dict(
        ratio=ratio,
        seed=seed,
        curve=curve,
        train_loss=statistics.fmean(tail),
        val_loss=val_loss(model, val),
        step_s=statistics.median(times),
        train_s=sum(times),
        cpu_s=time.process_time() - cpu0,
        max_logit=None if opt.qk_clip is None else opt.qk_clip.last_max_logit,
    )


def _worker(job):
    return train_one(*job)


def run_all(jobs: list[tuple], n_jobs: int):
    """Yields each run's result as it finishes (n_jobs worker processes; 1: in this process)."""
    if n_jobs == 1:
        for job in jobs:
            yield _worker(job)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(n_jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_worker, job) for job in jobs]
        for future in as_completed(futures):
            yield future.result()


def parse_args(argv=None):
    p = claim_parser("hybrid-ratio", __doc__)
    p.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {FULL['steps']})")
    p.add_argument("--hidden", type=int, default=None, help=f"model width, a multiple of 8 (default {FULL['hidden']})")
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers, at least 8 (default {FULL['layers']})")
    p.add_argument("--batch", type=int, default=None, help=f"windows per step (default {FULL['batch']})")
    p.add_argument("--seq", type=int, default=None, help=f"bytes per window (default {FULL['seq']})")
    p.add_argument("--lr", type=float, default=None, help=f"MuonClip's learning rate (default {FULL['lr']:g})")
    p.add_argument(
        "--eval-every", type=int, default=None, help=f"steps between curve points (default {FULL['eval_every']})"
    )
    p.add_argument(
        "--ratios", nargs="+", choices=list(RATIOS), default=list(RATIOS), help="KDA : MLA ratios to train (with 3:1)"
    )
    p.add_argument("--jobs", type=int, default=None, help="worker processes, one thread each (default 2; --quick 1)")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    opts = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    checks = (
        ("--steps", opts["steps"] >= 1, "at least 1"),
        (
            "--hidden",
            opts["hidden"] >= 8 and opts["hidden"] % 8 == 0,
            "a positive multiple of 8 (4 heads, rope half a head)",
        ),
        ("--layers", opts["layers"] >= 8, "at least 8 (7:1 needs 8 layers)"),
        ("--batch", opts["batch"] >= 1, "at least 1"),
        ("--seq", opts["seq"] >= 2, "at least 2"),
        ("--lr", opts["lr"] > 0 and math.isfinite(opts["lr"]), "a positive number"),
        ("--eval-every", opts["eval_every"] >= 1, "at least 1"),
        ("--jobs", args.jobs is None or args.jobs >= 1, "at least 1"),
        (
            "--ratios",
            REFERENCE in args.ratios and len(set(args.ratios)) >= 2,
            f"a list with {REFERENCE} (the reference) and at least one other ratio",
        ),
        ("--seeds", args.seeds is None or len(set(args.seeds)) == len(args.seeds) >= 1, "distinct"),
    )
    for flag, ok, what in checks:
        if not ok:
            p.error(f"{flag} must be {what}")
    jobs = args.jobs if args.jobs is not None else (1 if args.quick else 2)
    opts.update(
        val_batches=QUICK_VAL_BATCHES if args.quick else VAL_BATCHES,
        curve_batches=min(CURVE_BATCHES, QUICK_VAL_BATCHES if args.quick else VAL_BATCHES),
        ratios=[r for r in RATIOS if r in args.ratios],
        jobs=jobs,
        threads=1,  # small matmuls gain little from threads, and lose much when the cores are shared
    )
    return args, opts


def main(argv=None):
    args, opts = parse_args(argv)
    seeds, ratios = seeds_of(args), opts["ratios"]
    assert layer_types("3:1", opts["layers"]) == kimi_linear_layer_types(opts["layers"])
    opts["kv_lora_rank"] = rank = matched_kv_lora_rank(opts)
    kda_p, mla_p = mixer_params(opts, rank)
    models = {}
    for ratio in ratios:
        types = layer_types(ratio, opts["layers"])
        with torch.device("meta"):
            n = sum(p.numel() for p in KimiHybridForCausalLM(config(opts, types, rank)).parameters())
        models[ratio] = dict(
            layer_types=types, pattern=pattern(types), mla_layers=types.count("full_attention"), params=n
        )
    corpus = corpus_of(opts["corpus_bytes"])
    tokens = opts["steps"] * opts["batch"] * opts["seq"]
    print(
        f"# hybrid ratio: {opts['layers']} layers, hidden {opts['hidden']}, KDA layer {kda_p:,} / MLA layer {mla_p:,} "
        f"parameters (kv_lora_rank {rank}), MuonClip lr {opts['lr']:g}, {opts['steps']} steps of "
        f"{opts['batch']} x {opts['seq']} bytes ({tokens / 1e6:.2f} M bytes; {len(corpus.train) / 1e6:.2f} M train, "
        f"{len(corpus.val) / 1e6:.2f} M val), seeds {seeds}, {opts['jobs']} job(s)",
        flush=True,
    )
    # the runs with the most KDA layers (the slowest on CPU) first: two workers then end close together
    jobs = sorted(
        ((ratio, seed, opts) for seed in seeds for ratio in ratios),
        key=lambda j: -layer_types(j[0], opts["layers"]).count("linear_attention"),
    )
    runs = {}
    t0 = time.perf_counter()
    for r in run_all(jobs, opts["jobs"]):
        runs[r["ratio"], r["seed"]] = r
        print(
            f"{r['ratio']} seed {r['seed']}: train {r['train_loss']:.4f} val {r['val_loss']:.4f} nats/byte, "
            f"{r['step_s']:.3f} s/step, {r['cpu_s']:.0f} CPU s ({len(runs)}/{len(jobs)}, {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    wall = time.perf_counter() - t0

    def values(ratio, key):
        return [runs[ratio, s][key] for s in seeds]

    def paired(ratio):  # val(ratio) - val(3:1), seed by seed
        return [runs[ratio, s]["val_loss"] - runs[REFERENCE, s]["val_loss"] for s in seeds]

    ref_params = models[REFERENCE]["params"]
    print_table(
        f"Models ({opts['layers']} layers, K = KDA, M = MLA; parameters counted with embeddings and head)",
        ["ratio", "layers", "MLA layers", "params", "vs 3:1", "s/step (median)", "CPU s / run"],
        [
            [
                ratio,
                m["pattern"],
                m["mla_layers"],
                f"{m['params']:,}",
                f"{m['params'] - ref_params:+,}",
                cell(values(ratio, "step_s"), 3),
                cell(values(ratio, "cpu_s"), 1),
            ]
            for ratio, m in models.items()
        ],
    )
    print_table(
        f"Loss after {opts['steps']} steps (nats / byte; mean ± std [min, max] over seeds {seeds})",
        ["ratio", "train loss", "val loss", "val bits / byte", "val perplexity / byte", "Kimi Linear train / val ppl"],
        [
            [
                ratio,
                cell(values(ratio, "train_loss"), 4),
                cell(values(ratio, "val_loss"), 4),
                cell([v / math.log(2) for v in values(ratio, "val_loss")], 4),
                cell([math.exp(v) for v in values(ratio, "val_loss")], 4),
                "-" if PAPER[ratio] is None else f"{PAPER[ratio][0]:.2f} / {PAPER[ratio][1]:.2f}",
            ]
            for ratio in ratios
        ],
    )
    print_table(
        "Validation loss minus 3:1's, seed by seed (same data order; > 0: 3:1 is better)",
        ["ratio", "per seed", "mean ± std [min, max]", "seeds where 3:1 is lower"],
        [
            [
                ratio,
                " ".join(f"{d:+.4f}" for d in paired(ratio)),
                cell(paired(ratio), 4),
                f"{sum(d > 0 for d in paired(ratio))}/{len(seeds)}",
            ]
            for ratio in ratios
            if ratio != REFERENCE
        ],
    )
    means = {ratio: statistics.fmean(values(ratio, "val_loss")) for ratio in ratios}
    best = min(means, key=means.get)
    beaten = {ratio: sum(d > 0 for d in paired(ratio)) for ratio in ratios if ratio != REFERENCE}
    everywhere = all(n == len(seeds) for n in beaten.values())
    rival = min((r for r in ratios if r != REFERENCE), key=means.get)  # the best of the others
    gap = spread(paired(rival))
    gap_text = f"{rival} minus 3:1 = {gap['mean']:+.4f} ± {gap['std']:.4f} nats/byte over the seeds"
    if best == REFERENCE:
        verdict = (
            f"3:1 wins at this scale: lowest mean validation loss ({means[REFERENCE]:.4f} nats/byte; next {gap_text}), "
            + (
                "below every other ratio in every seed"
                if everywhere
                else "not in every seed: "
                + ", ".join(f"lower than {ratio} in {n}/{len(seeds)}" for ratio, n in beaten.items())
            )
        )
    else:
        verdict = (
            f"3:1 does not win at this scale: {best} has the lowest mean validation loss ({means[best]:.4f} against "
            f"3:1's {means[REFERENCE]:.4f} nats/byte; {gap_text}; 3:1 lower in {beaten[best]}/{len(seeds)} seeds)"
        )
    if args.quick:
        verdict += " (--quick: a smoke run of a few steps, not evidence either way)"
    print(f"\n{verdict}\nwall time {wall:.0f} s, {sum(r['cpu_s'] for r in runs.values()):.0f} CPU s in the runs")

    write_results(
        args.out,
        {
            "claim": "Kimi Linear: 3:1 KDA : MLA is the best hybrid ratio (train / val ppl 9.23 / 5.65; 0:1 9.45 / "
            "5.77, 1:1 9.29 / 5.66, 7:1 9.23 / 5.70)",
            "paper": {
                ratio: None if v is None else {"train_ppl": v[0], "val_ppl": v[1]} for ratio, v in PAPER.items()
            },
            "quick": args.quick,
            "setup": dict(
                {k: v for k, v in opts.items() if k not in ("jobs", "threads")},
                seeds=seeds,
                heads=HEADS,
                optimizer="MuonClip (Muon + AdamW, QK-Clip tau 100), weight decay 0.1, 5% warm-up + cosine to 0",
                loss_unit="nats per byte (next-byte cross-entropy); perplexity per byte = exp(loss)",
                kda_layer_params=kda_p,
                mla_layer_params=mla_p,
                train_bytes=len(corpus.train),
                val_bytes=len(corpus.val),
            ),
            "models": models,
            "runs": [runs[ratio, s] for s in seeds for ratio in ratios],
            "summary": {
                ratio: dict(
                    train_loss=spread(values(ratio, "train_loss")),
                    val_loss=spread(values(ratio, "val_loss")),
                    val_minus_3to1=spread(paired(ratio)),
                )
                for ratio in ratios
            },
            "verdict": dict(
                best=best,
                three_to_one_wins=best == REFERENCE,
                seeds_3to1_lower=beaten,
                rival=rival,
                rival_minus_3to1=gap,
                text=verdict,
            ),
            "wall_s": wall,
        },
    )

    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for ratio in ratios:
            steps = [s for s, _ in runs[ratio, seeds[0]]["curve"]]
            per_seed = [[v for _, v in runs[ratio, s]["curve"]] for s in seeds]
            mean = [statistics.fmean(col) for col in zip(*per_seed)]
            (line,) = ax1.plot(steps, mean, label=f"{ratio} ({models[ratio]['pattern']})")
            ax1.fill_between(
                steps,
                [min(c) for c in zip(*per_seed)],
                [max(c) for c in zip(*per_seed)],
                color=line.get_color(),
                alpha=0.2,
            )
        ax1.set(xlabel="step", ylabel="validation loss (nats / byte)", title="validation loss (mean, min-max band)")
        ax1.legend()
        xs = list(range(len(ratios)))
        finals = [values(ratio, "val_loss") for ratio in ratios]
        ax2.errorbar(
            xs,
            [statistics.fmean(v) for v in finals],
            yerr=[spread(v)["std"] for v in finals],
            fmt="o",
            capsize=4,
            label="mean ± std",
        )
        for x, v in zip(xs, finals):
            ax2.scatter([x] * len(v), v, s=10, color="gray", zorder=3)
        ax2.set_xticks(xs, list(ratios))
        ax2.set(
            xlabel="KDA : MLA",
            ylabel="final validation loss (nats / byte)",
            title=f"after {opts['steps']} steps, seeds {seeds}",
        )
        ax2.legend()

    save_plot(os.path.join(args.out, "hybrid_ratio.png"), draw, figsize=(12, 4.5))


if __name__ == "__main__":
    main()
