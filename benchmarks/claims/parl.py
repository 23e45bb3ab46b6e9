"""PARL (Kimi K2.5): an orchestrator policy trained with GRPO on ParlRewards, four reward arms against each other.

The claim (Kimi K2.5, arXiv 2602.02276; the seed articles): trained with r = lambda1 r_parallel + lambda2 r_finish
+ r_perf, lambdas annealed to 0, the orchestrator learns wide fan-outs of sub-agents that finish and cuts the
critical steps of wide search by 3x-4.5x against a single agent; without r_parallel it collapses to serial work
("serial collapse"); without r_finish it learns to spawn sub-agents that never finish ("spurious parallelism").

Setup (parl_env.py has the environment): wide-search tasks "the values of items 1..N of database K" (N uniform in
4..16, two tool calls an item) on kimi_hf's swarm runtime, with frozen scripted sub-agents (two items at most, a
badly specified sub-task fails) and a budget of 21 critical steps (serial work fits for N <= 10). The policy writes
the orchestrator's first turn in a compact plan language (`k3 1 2 ; k3 3 ; ...` or `@`, serial), played through
SwarmRollout; it is a tiny Kimi Linear (one KDA and one MLA layer, hidden 64, 30 tokens, 0.14 M parameters):
- warm start: TRL's SFTTrainer, 300 steps of 64 (lr 3e-3, cosine), on a 50/50 mix of serial plans (`@`) and random
  fan-outs (the items cut into 1..N groups of random sizes, many too big to finish): the format, and no
  preference between serial and parallel work. One warm start per seed, shared by its four arms.
- GRPO: TRL's GRPOTrainer, 160 steps of 12 tasks x 8 sampled plans (temperature 1, <= 48 tokens), lr 1e-3
  constant, TRL's defaults otherwise (loss "dapo", beta 0, rewards scaled per group), with
  `ParlRewards(rollout=..., perf_fn=<fraction of items right>, lambda1, lambda2)` at the package's defaults
  (lambdas 0.3, annealed to 0 over the first half of training, r_parallel saturating at 4 sub-agents).
- arms: full PARL (0.3, 0.3), no r_parallel (0, 0.3), no r_finish (0.3, 0), r_perf only (0, 0); seeds 0, 1, 2.
- metrics, on 256 held-out tasks (one plan sampled at temperature 1 each), and over training on each step's batch
  (TRL logs them): success (every item right), widest fan-out (sub-agent runs started in one turn, mean over
  episodes), no sub-agent (the fraction of serial episodes), finished (finished runs / runs), critical steps
  (Kimi K2.5's: per stage, the orchestrator step + the longest sub-agent run) and "vs serial": on the tasks the
  policy solved, the scripted serial agent's critical steps (2 N + 1) / the policy's.
Why these sizes: the policy learns the plan language from this warm start (about 93% of its sampled plans well
formed after 300 steps), and 3 seeds x (warm start + 4 arms) take about 30 minutes on one idle core (~90 CPU s a
warm start, 100-130 an arm; the full run of 2026-12-05 took 3,907 s on 2 cores shared with two other claims' workers,
--budget 33 1,338 s; one thread: a model this small gains nothing from more, and loses much on a busy machine);
the curves settle within the first 40 GRPO steps, the last 80 show what stays once the lambdas are 0.

    kimi-hf bench claims parl                 # the full setting: about 30 minutes on 2 idle cores
    kimi-hf bench claims parl --quick         # CI's smoke (a few steps): checks the script, not the claim
    kimi-hf bench claims parl --budget 33     # serial work always fits: no budget pull toward fan-outs
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import parl_env as env  # noqa: E402
from report import cell, claim_parser, print_table, save_plot, seeds_of, spread, write_results  # noqa: E402


# arm -> (lambda1: r_parallel's weight, lambda2: r_finish's weight); ParlRewards anneals both
ARMS = {
    "full PARL": (0.3, 0.3),
    "no r_parallel": (0.0, 0.3),
    "no r_finish": (0.3, 0.0),
    "r_perf only": (0.0, 0.0),
}
METRICS = ("success", "width", "serial", "finished", "critical", "ratio")


@dataclass(frozen=True)
class Setting:
    hidden: int = 64
    layers: int = 2  # KDA, MLA
    sft_steps: int = 300
    sft_batch: int = 64
    sft_lr: float = 3e-3
    grpo_steps: int = 160
    prompts: int = 12  # tasks per GRPO step
    generations: int = 8  # plans per task (the GRPO group)
    grpo_lr: float = 1e-3
    anneal_fraction: float = 0.5  # ParlRewards' default
    eval_tasks: int = 256
    max_completion: int = 3 * env.MAX_ITEMS  # `KEY ITEM ;` per item at the widest


FULL = Setting()
QUICK = Setting(sft_steps=4, sft_batch=16, grpo_steps=2, prompts=2, generations=4, eval_tasks=8, max_completion=24)


# ---- the policy: a tiny Kimi Linear over the plan language -----------------------------------------------------


def tokenizer():
    """One token a word of the plan language (transformers' fast tokenizer over a word-level vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(env.VOCAB)}, unk_token=env.PAD))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=env.PAD, eos_token=env.EOS)
    tok.padding_side = "left"
    return tok


def policy(setting: Setting, tok, seed: int):
    import torch

    from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig

    d = setting.hidden
    config = KimiHybridTextConfig(
        vocab_size=len(tok),
        hidden_size=d,
        intermediate_size=4 * d,
        num_hidden_layers=setting.layers,
        layer_types=["linear_attention", "full_attention"] * (setting.layers // 2),
        first_k_dense_replace=setting.layers,  # dense FFNs, no experts
        num_attention_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    model = KimiHybridForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


def quiet(trainer):
    """The trainer without its printed log lines (the logs stay in trainer.state.log_history)."""
    from transformers import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def train_args(out: str, seed: int) -> dict:
    return dict(output_dir=out, seed=seed, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1)


def warm_start(setting: Setting, tok, seed: int, out: str) -> dict:
    """SFT (TRL's SFTTrainer, loss on the completion) on a 50/50 mix of serial plans and random fan-outs; -> the
    state dict."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rng = random.Random(seed)
    tasks = env.sample_tasks(setting.sft_steps * setting.sft_batch, seed=10_000 + seed)
    rows = [{"prompt": t.prompt, "completion": " " + env.sft_example(t, rng)} for t in tasks]
    model = policy(setting, tok, seed)
    args = SFTConfig(
        **train_args(out, seed),
        max_steps=setting.sft_steps,
        per_device_train_batch_size=setting.sft_batch,
        learning_rate=setting.sft_lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, setting.sft_steps // 20),
        max_length=64,
    )
    quiet(SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)).train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- episodes and their metrics ---------------------------------------------------------------------------------


class Episodes:
    """Swarm episodes of (task prompt, plan) pairs, each played once: ParlRewards' rollout, the metrics of a set of
    plans, and a TRL reward function that rewards nothing (every value None) and logs a batch's metrics."""

    def __init__(self, budget: int = env.BUDGET):
        self.budget = budget
        self._results: dict = {}
        self._serial: dict = {}

    def rollout(self, prompt: str, completion: str):
        key = (prompt, completion)
        if key not in self._results:
            self._results[key] = env.rollout(prompt, completion, self.budget)
        return self._results[key]

    def serial(self, prompt: str) -> int:
        if prompt not in self._serial:
            self._serial[prompt] = env.serial_critical_steps(env.Task.parse(prompt))
        return self._serial[prompt]

    def summary(self, prompts, completions) -> dict:
        """success (every item right), width (the widest stage's sub-agent runs), serial (the fraction of episodes
        without a sub-agent run), finished (finished runs / runs, pooled; nan without runs), critical (critical
        steps, every episode), ratio (over the solved tasks: the serial agent's critical steps / the policy's; nan
        without one: a speed-up counts only for work done)."""
        results = [self.rollout(p, c) for p, c in zip(prompts, completions)]
        metrics = [r.metrics for r in results]
        solved = [env.score(r.answer, p) == 1.0 for r, p in zip(results, prompts)]
        runs = sum(max(m["num_tasks"], m["num_subagents"]) for m in metrics)
        done = [(self.serial(p), m["critical_steps"]) for p, m, ok in zip(prompts, metrics, solved) if ok]
        return {
            "success": statistics.fmean(solved),
            "width": statistics.fmean(m["max_width"] for m in metrics),
            "serial": statistics.fmean(m["max_width"] == 0 for m in metrics),
            "finished": sum(m["finished_tasks"] for m in metrics) / runs if runs else math.nan,
            "critical": statistics.fmean(m["critical_steps"] for m in metrics),
            "ratio": sum(s for s, _ in done) / sum(c for _, c in done) if done else math.nan,
        }

    def swarm_metrics(self, prompts, completions, log_metric=None, **_):
        if log_metric is not None:
            for name, v in self.summary(prompts, completions).items():
                if not math.isnan(v):
                    log_metric(f"swarm/{name}", v)
        return [None] * len(prompts)


def sample_plans(model, tok, prompts: list[str], setting: Setting, seed: int, batch: int = 128) -> list[str]:
    """The policy's plans for the prompts, sampled at temperature 1 (as in training)."""
    import torch

    torch.manual_seed(seed)
    model.eval()
    plans = []
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True)
            out = model.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=setting.max_completion)
            plans += tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return plans


def grpo(setting: Setting, tok, sft_state: dict, arm: str, seed: int, out: str, budget: int):
    """GRPO (TRL's GRPOTrainer) from the warm start with the arm's ParlRewards; -> (model, the per-step metrics)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from kimi_hf.swarm import ParlRewards

    lambda1, lambda2 = ARMS[arm]
    episodes = Episodes(budget)
    parl = ParlRewards(
        rollout=episodes.rollout,
        perf_fn=lambda answer, task: env.score(answer, task),
        lambda1=lambda1,
        lambda2=lambda2,
        anneal_fraction=setting.anneal_fraction,
    )
    tasks = env.sample_tasks(setting.grpo_steps * setting.prompts, seed=20_000 + seed)
    model = policy(setting, tok, seed)
    model.load_state_dict(sft_state)
    args = GRPOConfig(
        **train_args(out, seed),
        max_steps=setting.grpo_steps,
        per_device_train_batch_size=setting.prompts * setting.generations,
        num_generations=setting.generations,
        max_completion_length=setting.max_completion,
        learning_rate=setting.grpo_lr,
        lr_scheduler_type="constant",
        temperature=1.0,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[*parl.reward_funcs, episodes.swarm_metrics],
        args=args,
        # the task again as a column: TRL passes the reward functions every column but the prompt
        train_dataset=Dataset.from_list([{"prompt": t.prompt, "task": t.prompt} for t in tasks]),
        processing_class=tok,
    )
    quiet(trainer).train()
    log = [
        {"step": h["step"], **{m: h.get(f"swarm/{m}", math.nan) for m in METRICS}}
        for h in trainer.state.log_history
        if "swarm/success" in h
    ]
    return model, log


def run_seed(setting: Setting, seed: int, out: str, eval_prompts: list[str], budget: int) -> dict:
    """One warm start, then the four arms from it; each policy evaluated on the held-out tasks."""
    tok = tokenizer()
    t0 = time.perf_counter()
    sft_state = warm_start(setting, tok, seed, os.path.join(out, "sft"))
    model = policy(setting, tok, seed)
    model.load_state_dict(sft_state)
    episodes = Episodes(budget)
    start = episodes.summary(eval_prompts, sample_plans(model, tok, eval_prompts, setting, seed))
    result = {"warm start": start, "sft_seconds": time.perf_counter() - t0, "arms": {}}
    print(f"seed {seed}, warm start: {fmt(start)} ({result['sft_seconds']:.0f} s)", flush=True)
    for arm in ARMS:
        t0 = time.perf_counter()
        model, log = grpo(setting, tok, sft_state, arm, seed, os.path.join(out, "grpo"), budget)
        final = episodes.summary(eval_prompts, sample_plans(model, tok, eval_prompts, setting, seed))
        result["arms"][arm] = {"final": final, "curve": log, "seconds": time.perf_counter() - t0}
        print(f"seed {seed}, {arm}: {fmt(final)} ({result['arms'][arm]['seconds']:.0f} s)", flush=True)
    return result


def fmt(m: dict) -> str:
    return ", ".join(f"{k} {fixed(m[k])}" for k in METRICS)


# ---- the report ------------------------------------------------------------------------------------------------


def serial_reference(prompts: list[str], budget: int) -> dict:
    """The serial agent on the held-out tasks: success within the budget, critical steps to finish."""
    steps = [Episodes(budget).serial(p) for p in prompts]
    return {"success": statistics.fmean(s <= budget for s in steps), "critical": statistics.fmean(steps)}


def values(per_seed: list[dict], arm: str | None, metric: str) -> list[float]:
    """The seeds' final values of a metric (arm None: the warm start), nan left out."""
    got = [(r["warm start"] if arm is None else r["arms"][arm]["final"])[metric] for r in per_seed]
    return [v for v in got if not math.isnan(v)]


def mean(per_seed, arm, metric) -> float:
    vs = values(per_seed, arm, metric)
    return statistics.fmean(vs) if vs else math.nan


def fixed(value: float, digits: int = 2) -> str:
    """A number for a table, "-" for nan (a fraction of runs where no sub-agent ran, say)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def claims(per_seed: list[dict], serial: dict) -> list[list[str]]:
    """Each claim: what reproducing it means here, what we measured (seeds' means), reproduced or not."""
    m = lambda arm, metric: mean(per_seed, arm, metric)  # noqa: E731
    collapse, full_serial = m("no r_parallel", "serial"), m("full PARL", "serial")
    spurious, full_finished = m("no r_finish", "finished"), m("full PARL", "finished")
    ratio, success = m("full PARL", "ratio"), m("full PARL", "success")
    return [
        [
            "without r_parallel: serial collapse",
            "no-r_parallel episodes without a sub-agent >= 0.5, and 0.2 above full PARL's",
            f"{fixed(collapse)} (full PARL {fixed(full_serial)}, warm start {fixed(m(None, 'serial'))})",
            "yes" if collapse >= 0.5 and collapse >= full_serial + 0.2 else "no",
        ],
        [
            "without r_finish: spurious parallelism",
            "no-r_finish finished fraction 0.1 below full PARL's, at >= 0.8 of its fan-out",
            f"{fixed(spurious)} finished, fan-out {fixed(m('no r_finish', 'width'), 1)} (full PARL "
            f"{fixed(full_finished)}, {fixed(m('full PARL', 'width'), 1)}; r_perf only "
            f"{fixed(m('r_perf only', 'finished'))})",
            "yes"
            if spurious <= full_finished - 0.1 and m("no r_finish", "width") >= 0.8 * m("full PARL", "width")
            else "no",
        ],
        [
            "with both: 3x-4.5x fewer critical steps",
            f"full PARL >= 3x the serial agent, at success >= the serial agent's ({serial['success']:.2f})",
            (f"{ratio:.2f}x" if not math.isnan(ratio) else "no task solved") + f" at success {success:.2f}",
            "yes" if ratio >= 3.0 and success >= serial["success"] else "no",
        ],
    ]


def curve(per_seed: list[dict], arm: str, metric: str, window: int) -> tuple[list[int], list[float]]:
    """Per training step, the seeds' mean of a batch metric, averaged over the last `window` steps."""
    logs = [r["arms"][arm]["curve"] for r in per_seed]
    steps = sorted({e["step"] for log in logs for e in log})
    at = {s: [e[metric] for log in logs for e in log if e["step"] == s and not math.isnan(e[metric])] for s in steps}
    means = [statistics.fmean(at[s]) if at[s] else math.nan for s in steps]
    smooth = []
    for i in range(len(means)):
        part = [v for v in means[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        smooth.append(statistics.fmean(part) if part else math.nan)
    return steps, smooth


def draw(fig, per_seed: list[dict], setting: Setting, serial: dict, window: int) -> None:
    """Per arm, the curves over training (seeds' mean, smoothed) of the speed-up, fan-out, finishing and success."""
    panels = (
        ("ratio", "critical steps: serial agent / policy (solved tasks)"),
        ("width", "widest fan-out"),
        ("finished", "finished fraction of sub-agent runs"),
        ("success", "task success"),
    )
    for i, (metric, title) in enumerate(panels):
        ax = fig.add_subplot(2, 2, i + 1)
        for arm in per_seed[0]["arms"]:
            ax.plot(*curve(per_seed, arm, metric, window), label=arm)
        ax.axvline(setting.anneal_fraction * setting.grpo_steps, color="grey", linestyle=":", linewidth=1)
        if metric == "ratio":
            ax.axhspan(3.0, 4.5, color="grey", alpha=0.15, label="K2.5: 3x-4.5x")
            ax.legend(fontsize=7)
        if metric == "success":
            ax.axhline(serial["success"], color="black", linestyle="--", linewidth=1, label="serial agent")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("GRPO step", fontsize=8)
    fig.suptitle(
        f"PARL arms, mean of {len(per_seed)} seed(s), smoothed over {window} steps (dotted: the lambdas reach 0; "
        "dashed: the serial agent)",
        fontsize=10,
    )


def checkpoints(total: int) -> list[int]:
    return sorted({1, *(max(1, round(total * f)) for f in (0.25, 0.5, 0.75, 1.0))})


def nan_to_none(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [nan_to_none(v) for v in x]
    return x


def main(argv=None) -> dict:
    p = claim_parser("parl", __doc__)
    p.add_argument(
        "--budget",
        type=int,
        default=env.BUDGET,
        help=f"critical steps an episode may take (default {env.BUDGET}: serial work fits for N <= 10)",
    )
    args = p.parse_args(argv)
    if args.budget < 5:
        p.error(f"--budget must be >= 5 (the fastest finished plan takes 5 critical steps), got {args.budget}")
    if args.seeds is not None and any(s < 0 for s in args.seeds):
        p.error(f"--seeds must be >= 0, got {args.seeds}")
    setting = QUICK if args.quick else FULL
    seeds = seeds_of(args)
    import torch

    # one thread: the model's matrices are too small to gain from more (and lose much on a busy machine)
    torch.set_num_threads(1)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore")
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    disable_progress_bar()

    eval_prompts = [t.prompt for t in env.sample_tasks(setting.eval_tasks, seed=999_999)]
    serial = serial_reference(eval_prompts, args.budget)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        per_seed = [run_seed(setting, s, os.path.join(scratch, str(s)), eval_prompts, args.budget) for s in seeds]
    seconds = time.perf_counter() - t0

    rows = [["serial agent (scripted)", f"{serial['success']:.2f}", "0", "1", "-", f"{serial['critical']:.2f}", "1x"]]
    for arm in [None, *ARMS]:
        ratios = values(per_seed, arm, "ratio")
        rows.append(
            [arm or "warm start (SFT)"]
            + [cell(values(per_seed, arm, metric), 2) for metric in METRICS[:-1]]
            + [cell(ratios, 2) + "x" if ratios else "-"]
        )
    print_table(
        f"PARL on wide search, after {setting.grpo_steps} GRPO steps: {setting.eval_tasks} held-out tasks, budget "
        f"{args.budget} critical steps, seeds {seeds} (mean ± std [min, max])",
        ["policy", "success", "widest fan-out", "no sub-agent", "finished", "critical steps", "vs serial"],
        rows,
    )
    window = max(1, setting.grpo_steps // 8)
    curve_rows = []
    for arm in ARMS:
        got = {metric: dict(zip(*curve(per_seed, arm, metric, window))) for metric in METRICS}
        for step in checkpoints(setting.grpo_steps):
            curve_rows.append(
                [arm, str(step)] + [fixed(got[metric].get(step, math.nan)) for metric in METRICS if metric != "serial"]
            )
    print_table(
        f"Over training (each step's batch of {setting.prompts} x {setting.generations} plans, seeds' mean over the "
        f"last {window} steps; the lambdas are 0 from step {round(setting.anneal_fraction * setting.grpo_steps)})",
        ["arm", "step", "success", "widest fan-out", "finished", "critical steps", "vs serial"],
        curve_rows,
    )
    claim_rows = claims(per_seed, serial)
    print_table("The claims at this scale", ["claim", "reproduced when", "measured", "reproduced"], claim_rows)
    print(f"\n{seconds:.0f} s for {len(seeds)} seed(s) x (warm start + {len(ARMS)} arms)")

    plot = os.path.join(args.out, "parl.png")
    save_plot(plot, lambda fig: draw(fig, per_seed, setting, serial, window), figsize=(10, 7.5))
    payload = {
        "claim": "parl",
        "quick": args.quick,
        "setting": asdict(setting),
        "budget": args.budget,
        "seeds": seeds,
        "arms": {arm: {"lambda1": l1, "lambda2": l2} for arm, (l1, l2) in ARMS.items()},
        "serial_agent": serial,
        "summary": {
            arm or "warm start": {metric: spread(values(per_seed, arm, metric)) for metric in METRICS}
            for arm in [None, *ARMS]
        },
        "claims": [dict(zip(("claim", "reproduced_when", "measured", "reproduced"), row)) for row in claim_rows],
        "per_seed": per_seed,
        "seconds": seconds,
        "plot": plot,
    }
    write_results(args.out, nan_to_none(payload))
    return payload


if __name__ == "__main__":
    main()
