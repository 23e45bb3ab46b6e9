"""Recall: per-channel forgetting (KDA) against one forget rate per head (Gated DeltaNet's gate), on MQAR and
Palindrome.

The claim (Kimi Linear, arXiv 2510.26692, synthetic tests): one decay rate per channel keeps what matters and drops
noise, where Gated DeltaNet's one rate per head cannot. The paper trains 2-layer models on Palindrome, MQAR and Stack
at 256 to 2048 tokens; at 2048 KDA stays near 100% accuracy where GDN reaches about 75%.

The models: the package's own layers, 2 layers each, hidden 64, two heads of 32 (dense SwiGLU MLPs of 128):
- kda: two `KimiDeltaAttention` layers, Kimi Linear's gate g = -exp(A_log[h]) softplus(W_fb W_fa x + dt_bias), one
  log-decay per channel (H * K a token);
- gdn: the same layers and op with one decay per head: W_fb's rows and dt_bias tied across a head's K channels (a
  torch parametrization [H, r] -> [H * K, r], [H] -> [H * K]; A_log is per head already), i.e. Gated DeltaNet's
  gate g_h = -exp(A_log[h]) softplus(w_h . W_fa x + dt_bias[h]) fed to the same KDA op, dt_bias drawn per head from
  the same law. Short convs, L2-normed q / k, beta, output gate and norm are unchanged: the gate is the only
  difference. Defined here rather than as a model option: it reparametrizes existing parameters, nothing more;
- mla: two of Kimi Linear's MLA layers (full attention without positional encoding: Kimi Linear's MLA is NoPE);
- hybrid: `kimi_linear_layer_types(2)` = KDA then MLA. A 2-layer 3:1 hybrid cannot exist; Kimi Linear's rule (MLA at
  every 4th layer and at the last one) gives 1:1 at 2 layers, which keeps depth and width equal to the others';
- kda-dt0 (the dt_bias question: a community reproduction found MQAR learns only with Kimi Linear's dt_bias init):
  kda with dt_bias initialised to zeros instead of the inverse softplus of dt ~ logU(1e-3, 1e-1), on MQAR at the
  first length only.
The parameter counts are printed (within 20%: MLA's layers are smaller than KDA's at the same width).

The tasks (`--tasks`, default both). MQAR (multi-query associative recall, after Zoology's): a sequence opens with
P = 16 key-value pairs k1 v1 ... kP vP (distinct keys of 64 key tokens, values of 64 value tokens); of the remaining
T - 2P tokens, half (at random positions) are queries, a key of the pairs each, at which the model must predict that
key's value, and half are noise tokens (16 of them) that a recurrent state must not let overwrite its memory. The
departure from Zoology, which asks each key once: the queries are dense (112 a sequence at 256 tokens, 240 at 512),
7-15x more training signal a token, which is what lets 2000 CPU steps learn the task. P is the same at every length,
so a longer T means more noise between the pairs and their queries (the claim's "drops noise"), not more to remember.
Palindrome (as the paper's, which grows the sequence to remember with T): N = T / 2 symbols (of the 64 key tokens,
drawn with replacement), a separator, then the symbols reversed, teacher-forced: from the separator on each position
predicts the next symbol of the reversal (N answers a sequence: 128 at 256 tokens, 256 at 512). With 64 symbols a
symbol repeats within the sequence (twice on average at 256 tokens), so the previous answer alone is ambiguous:
position helps, and the layers have none but what KDA's decays and short convolutions make (MLA is NoPE).
`--content N` fixes N instead and fills the T - 2N tokens between the symbols and the separator with noise.
Loss: cross-entropy at the query (answer) tokens. Accuracy: the share of answer tokens of a fixed evaluation set (the
same 128 sequences for every model and seed) predicted right by argmax, every 50 steps; "steps to 90%" is the first
evaluation at or above 0.9. Calibration (seed 0, one run each): 16 symbols followed by 224 noise tokens learn nothing
in 600 steps for any model; pure palindromes of 16 / 32 symbols reach 0.94-0.99 in 800 steps with KDA or the GDN
gate, 64 symbols 0.74 / 0.83 after 800, where MLA reaches 0.18 after 600 steps at 16 symbols.

Training: AdamW (lr 1e-3, betas 0.9 / 0.98, weight decay 0.1 on matrices, 5% warm-up then cosine to 10%, gradient
clip 1), as the synthetic-recall literature trains (Zoology, Gated DeltaNet), so that the comparison is the
architectures', not MuonClip's; 2000 steps of 2048 tokens (batch 8 at 256 tokens, 4 at 512), seeds 0 1 2 (a seed
sets the initialisation and the data order; every model of one seed sees the same batches). Gates, decays and the
KDA state are fp32 (the whole run is). The seeds matter for the per-head gate: with 2 heads, whether one head starts
with a slow decay is a draw of 2 values (kda draws 64 per layer). These sizes and steps are what 2 CPU cores train in
about 55 minutes, MQAR and Palindrome together (the full runs of 2026-12-05: MQAR 3,707 CPU s in 27 runs, Palindrome
2,931 CPU s in 24 runs): 0.07-0.10 s of CPU a step (evaluations included) for the models of two KDA layers, about
0.04-0.06 s for mla / hybrid; one worker process a core, one thread each.

    kimi-hf bench claims recall                     # the full setting, 2 worker processes (about 55 min, 2 idle cores)
    kimi-hf bench claims recall --tasks palindrome  # one task (Palindrome about 25 min, MQAR about 31)
    kimi-hf bench claims recall --quick             # CI's smoke run: a few steps, checks the script, not the claim
    kimi-hf bench claims recall --arms kda gdn --lengths 256 --steps 1500 --seeds 0 --workers 1

Prints, for each task, the final accuracy and the steps to 90% per model and length (mean ± std [min, max] over the
seeds), then the dt_bias comparison (MQAR), and writes OUT/results.json and OUT/recall.png (accuracy against steps, a
row of panels a task, a panel a length; mean over the seeds with their min-max band).
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from report import cell, claim_parser, positive_int, print_table, save_plot, seeds_of, spread, write_results
from torch.nn.utils import parametrize

from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiDeltaAttention


KDA, MLA = "linear_attention", "full_attention"
# name -> (label, layer types, gate: "channel" (KDA's) or "head" (Gated DeltaNet's), dt_bias init: "kimi" or "zeros")
ARMS = {
    "kda": ("KDA (per-channel decay)", [KDA, KDA], "channel", "kimi"),
    "gdn": ("GDN gate (per-head decay)", [KDA, KDA], "head", "kimi"),
    "mla": ("MLA (full attention)", [MLA, MLA], None, None),
    "hybrid": ("hybrid KDA + MLA", kimi_linear_layer_types(2), "channel", "kimi"),
}
ABLATION = {"kda-dt0": ("KDA, dt_bias = 0", [KDA, KDA], "channel", "zeros")}
ALL_ARMS = {**ARMS, **ABLATION}
THRESHOLD = 0.9

# MQAR's vocabulary: 0 unused, then keys, values, noise, and the bos / eos ids the config wants (never in the data)
N_KEYS, N_VALUES, N_NOISE = 64, 64, 16
KEY0, VALUE0, NOISE0 = 1, 1 + N_KEYS, 1 + N_KEYS + N_VALUES
VOCAB = 3 + N_KEYS + N_VALUES + N_NOISE
SEPARATOR = VALUE0  # Palindrome's separator: a value token (Palindrome has no values), so both tasks share VOCAB


# --------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------
def mqar_batch(gen: torch.Generator, batch: int, T: int, pairs: int):
    """input ids [batch, T], the query positions (bool [batch, T]) and their values [number of queries] (row-major).

    The first 2 * pairs tokens are the pairs; of the rest, half (at random positions) are queries of a key drawn
    uniformly from the pairs', half noise tokens."""
    queries = (T - 2 * pairs) // 2
    if queries < 1 or pairs > N_KEYS:
        raise ValueError(f"MQAR: {pairs} pairs leave no room for queries in {T} tokens, or exceed {N_KEYS} keys")
    keys = torch.rand(batch, N_KEYS, generator=gen).argsort(-1)[:, :pairs] + KEY0  # distinct keys per sequence
    values = torch.randint(VALUE0, VALUE0 + N_VALUES, (batch, pairs), generator=gen)
    x = torch.randint(NOISE0, NOISE0 + N_NOISE, (batch, T), generator=gen)
    x[:, 0 : 2 * pairs : 2], x[:, 1 : 2 * pairs : 2] = keys, values
    slots = torch.rand(batch, T - 2 * pairs, generator=gen).argsort(-1)[:, :queries].sort(-1).values + 2 * pairs
    asked = torch.randint(0, pairs, (batch, queries), generator=gen)  # which pair each query asks for
    x.scatter_(1, slots, keys.gather(1, asked))
    query = torch.zeros(batch, T, dtype=torch.bool).scatter_(1, slots, True)
    return x, query, values.gather(1, asked).flatten()  # slots sorted: the mask's row-major order is `asked`'s


def palindrome_batch(gen: torch.Generator, batch: int, T: int, content: int):
    """input ids [batch, T], the answer positions (bool [batch, T]) and their targets [batch * content] (row-major).

    A sequence: `content` symbols c_1 .. c_N (key tokens, drawn with replacement), T - 2N noise tokens, the separator,
    then the symbols reversed c_N .. c_2 as teacher-forced inputs: from the separator on, each position must predict
    the next symbol of the reversal (c_N at the separator, ..., c_1 at the last position)."""
    gap = T - 2 * content
    if content < 1 or gap < 0:
        raise ValueError(f"Palindrome: {content} symbols and their reversal do not fit in {T} tokens")
    symbols = torch.randint(KEY0, KEY0 + N_KEYS, (batch, content), generator=gen)
    x = torch.randint(NOISE0, NOISE0 + N_NOISE, (batch, T), generator=gen)
    x[:, :content] = symbols
    x[:, content + gap] = SEPARATOR
    reversed_ = symbols.flip(-1)
    x[:, content + gap + 1 :] = reversed_[:, :-1]
    query = torch.zeros(batch, T, dtype=torch.bool)
    query[:, content + gap :] = True
    return x, query, reversed_.flatten()


# name -> (title, batch function (gen, batch, T, size) -> (input ids, answer mask, targets), the offset of its data
# seeds: MQAR's 0 keeps the generators its published runs used, Palindrome's keeps its data apart from MQAR's)
TASKS = {"mqar": ("MQAR", mqar_batch, 0), "palindrome": ("Palindrome", palindrome_batch, 5_000_000)}


# --------------------------------------------------------------------------------------------
# The models
# --------------------------------------------------------------------------------------------
class SharedPerHead(nn.Module):
    """A parametrization tying each head's K channels: [H, ...] -> [H * K, ...] (each row repeated K times). Its
    right inverse (the mean over the K channels) only runs when it is registered."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(self.channels, dim=0)

    def right_inverse(self, y: torch.Tensor) -> torch.Tensor:
        return y.view(-1, self.channels, *y.shape[1:]).mean(1)


def kimi_dt_bias(n: int, gen: torch.Generator) -> torch.Tensor:
    """Kimi Linear's (and Mamba2's) dt_bias init for n values: the inverse softplus of dt ~ logU(1e-3, 1e-1), clamped
    >= 1e-4, as KimiHybridPreTrainedModel._init_weights draws it."""
    dt = torch.empty(n).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def config(layer_types: list[str], hidden: int) -> KimiHybridTextConfig:
    heads = 2
    return KimiHybridTextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        mlp_layer_types=["dense"] * len(layer_types),
        num_attention_heads=heads,
        kv_lora_rank=hidden // 2,
        qk_nope_head_dim=hidden // heads,
        qk_rope_head_dim=8,
        v_head_dim=hidden // heads,
        linear_num_heads=heads,
        linear_head_dim=hidden // heads,
        pad_token_id=0,
        bos_token_id=VOCAB - 2,
        eos_token_id=VOCAB - 1,
        use_cache=False,
    )


def build(name: str, hidden: int, seed: int) -> KimiHybridForCausalLM:
    """The arm's model initialised from `seed`: the package's init, then the gate's variant and dt_bias init."""
    _, layer_types, gate, dt_init = ALL_ARMS[name]
    torch.manual_seed(seed)
    model = KimiHybridForCausalLM(config(layer_types, hidden))
    gen = torch.Generator().manual_seed(10_000 + seed)
    std = model.config.initializer_range
    with torch.no_grad():
        for module in model.modules():
            if not isinstance(module, KimiDeltaAttention):
                continue
            if gate == "head":  # Gated DeltaNet's gate: one forget input and one dt_bias per head
                K = module.head_dim
                parametrize.register_parametrization(module.f_b_proj, "weight", SharedPerHead(K))
                parametrize.register_parametrization(module, "dt_bias", SharedPerHead(K))
                module.f_b_proj.parametrizations.weight.original.normal_(0.0, std, generator=gen)
                dt_bias = module.parametrizations.dt_bias.original
                dt_bias.copy_(kimi_dt_bias(dt_bias.numel(), gen))  # one dt per head, from Kimi Linear's law
            else:
                dt_bias = module.dt_bias  # per channel, as the package initialises it
            if dt_init == "zeros":
                dt_bias.zero_()
    return model


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def accuracy(model, evaluation) -> float:
    model.eval()
    hits = total = 0
    for x, query, values in evaluation:
        hits += (model(input_ids=x).logits[query].argmax(-1) == values).sum().item()
        total += values.numel()
    model.train()
    return hits / total


def train(job: dict) -> dict:
    """One (arm, length, seed) run: the accuracy curve [(step, accuracy)], the mean training loss of each
    evaluation interval, the final accuracy, the first step at or above THRESHOLD (None if never), the wall and
    CPU seconds."""
    torch.set_num_threads(1)  # at these sizes intra-op threads cost more than they give: one process a core
    torch.set_flush_denormal(True)
    T, seed, steps, batch, size = job["T"], job["seed"], job["steps"], job["batch"], job["size"]
    _, make_batch, offset = TASKS[job["task"]]
    model = build(job["name"], job["hidden"], seed).train()
    egen = torch.Generator().manual_seed(123_456 + T + offset)  # the same evaluation set for every arm and seed
    evaluation = [make_batch(egen, batch, T, size) for _ in range(max(1, job["eval_seqs"] // batch))]
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=job["lr"], betas=(0.9, 0.98), weight_decay=0.1)
    warmup = max(1, steps // 20)

    def lr_factor(s):  # s: the steps taken so far
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(seed * 1_000 + T + offset)  # the seed's data order, the same for every arm
    curve, losses, interval = [], [], []
    start, cpu = time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        x, query, values = make_batch(gen, batch, T, size)
        loss = F.cross_entropy(model(input_ids=x).logits[query].float(), values)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        interval.append(loss.item())
        if step % job["eval_every"] == 0 or step == steps:
            curve.append((step, accuracy(model, evaluation)))
            losses.append((step, sum(interval) / len(interval)))
            interval = []
    return {
        "task": job["task"],
        "arm": job["name"],
        "T": T,
        "seed": seed,
        "curve": curve,
        "loss": losses,
        "final": curve[-1][1],
        "step_to_threshold": next((s for s, a in curve if a >= THRESHOLD), None),
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,
    }


def run_all(jobs: list[dict], workers: int) -> list[dict]:
    """The jobs' results, in the jobs' order: in this process (workers 1) or in `workers` single-threaded processes
    (every run seeds itself: the numbers do not depend on the number of workers)."""
    done = []

    def report(r):
        reached = "-" if r["step_to_threshold"] is None else r["step_to_threshold"]
        print(
            f"# {r['task']} {r['arm']} T={r['T']} seed {r['seed']}: final accuracy {r['final']:.3f}, "
            f"{THRESHOLD:.0%} at step {reached} ({r['seconds']:.0f} s, {r['cpu_seconds']:.0f} s CPU)",
            flush=True,
        )
        done.append(r)

    if workers == 1:
        for job in jobs:
            report(train(job))
    else:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
            for r in pool.imap_unordered(train, jobs):
                report(r)
    order = {(j["task"], j["name"], j["T"], j["seed"]): i for i, j in enumerate(jobs)}
    return sorted(done, key=lambda r: order[(r["task"], r["arm"], r["T"], r["seed"])])


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------
def steps_cell(runs: list[dict]) -> str:
    """The steps to THRESHOLD over the seeds that reached it, and how many did."""
    reached = [r["step_to_threshold"] for r in runs if r["step_to_threshold"] is not None]
    if not reached:
        return f"never (0/{len(runs)})"
    return f"{cell(reached, 0)} ({len(reached)}/{len(runs)})"


def parse_args(argv=None):
    p = claim_parser("recall", __doc__)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=None, help="default: all")
    p.add_argument("--arms", nargs="+", choices=list(ALL_ARMS), default=None, help="default: all")
    p.add_argument("--lengths", type=positive_int, nargs="+", default=[256, 512], help="sequence lengths")
    p.add_argument("--pairs", type=positive_int, default=16, help=f"MQAR's key-value pairs (at most {N_KEYS})")
    p.add_argument(
        "--content", type=positive_int, default=None, help="Palindrome's symbols a sequence (default: half of it)"
    )
    p.add_argument("--steps", type=positive_int, default=None, help="training steps a run (default 2000, --quick 3)")
    p.add_argument(
        "--batch-tokens", type=positive_int, default=None, help="tokens a step, batch = this / T (default 2048)"
    )
    p.add_argument("--hidden", type=positive_int, default=64, help="model width (two heads of hidden / 2)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate")
    p.add_argument("--eval-every", type=positive_int, default=None, help="steps between evaluations (default 50)")
    p.add_argument("--eval-seqs", type=positive_int, default=None, help="evaluation sequences (default 128)")
    p.add_argument("--workers", type=positive_int, default=None, help="processes (default 2, --quick 1)")
    args = p.parse_args(argv)
    args.tasks = list(dict.fromkeys(args.tasks or TASKS))  # in order, once each
    args.arms = list(dict.fromkeys(args.arms or ALL_ARMS))
    args.lengths = list(dict.fromkeys(args.lengths))
    if "mqar" not in args.tasks and set(args.arms) <= set(ABLATION):
        p.error(f"--arms {' '.join(args.arms)}: the dt_bias ablation runs on MQAR only (add --tasks mqar or an arm)")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if args.hidden % 2:
        p.error(f"--hidden must be even (two heads), got {args.hidden}")
    if args.pairs > N_KEYS:
        p.error(f"--pairs must be at most {N_KEYS} (the key tokens), got {args.pairs}")
    if "mqar" in args.tasks and min(args.lengths) < 4 * args.pairs:
        p.error(f"--lengths must be at least 4 x --pairs = {4 * args.pairs} (pairs, then queries), got {args.lengths}")
    if "palindrome" in args.tasks and args.content is not None and min(args.lengths) < 2 * args.content:
        p.error(
            f"--lengths must be at least 2 x --content = {2 * args.content} (the symbols, then their reversal), got "
            f"{args.lengths}"
        )
    args.steps = args.steps or (3 if args.quick else 2000)
    args.batch_tokens = args.batch_tokens or (512 if args.quick else 2048)
    if args.batch_tokens < max(args.lengths):
        p.error(
            f"--batch-tokens must hold a sequence of the longest length {max(args.lengths)}, got {args.batch_tokens}"
        )
    args.eval_every = args.eval_every or (args.steps if args.quick else 50)
    args.eval_seqs = args.eval_seqs or (4 if args.quick else 128)
    args.workers = args.workers or (1 if args.quick else min(2, os.cpu_count() or 1))
    return args


def task_size(args, task: str, T: int) -> int:
    """The batch function's size argument: MQAR's pairs, Palindrome's symbols (--content, or half of T)."""
    if task == "mqar":
        return args.pairs
    return args.content or T // 2


def main(argv=None):
    args = parse_args(argv)
    seeds, lengths = seeds_of(args), args.lengths
    common = dict(
        steps=args.steps, hidden=args.hidden, lr=args.lr, eval_every=args.eval_every, eval_seqs=args.eval_seqs
    )

    def lengths_of(task, name):  # the dt_bias ablation: MQAR (the community's task) at the first length only
        if name in ABLATION:
            return lengths[:1] if task == "mqar" else []
        return lengths

    jobs = [
        dict(common, task=task, name=name, T=T, seed=seed, batch=args.batch_tokens // T, size=task_size(args, task, T))
        for task in args.tasks
        for name in args.arms
        for T in lengths_of(task, name)
        for seed in seeds
    ]
    params = {name: parameter_count(build(name, args.hidden, 0)) for name in args.arms}
    described = {
        "mqar": f"MQAR with {args.pairs} key-value pairs ({N_KEYS} keys, {N_VALUES} values, {N_NOISE} noise tokens)",
        "palindrome": f"Palindrome of {args.content or 'T / 2'} symbols ({N_KEYS} of them)",
    }
    print(
        f"# {'; '.join(described[t] for t in args.tasks)}; 2-layer models, hidden {args.hidden}; AdamW lr "
        f"{args.lr:g}, {args.batch_tokens} tokens a step, {args.steps} steps; seeds {seeds}; {len(jobs)} runs on "
        f"{args.workers} worker(s)",
        flush=True,
    )
    start = time.perf_counter()
    runs = run_all(jobs, args.workers)
    wall = time.perf_counter() - start

    def of(task, name, T):
        return [r for r in runs if r["task"] == task and r["arm"] == name and r["T"] == T]

    def label(name):
        return ALL_ARMS[name][0]

    main_arms = [n for n in args.arms if n in ARMS]
    Ts = [f"T={T}" for T in lengths]
    for task in args.tasks if main_arms else []:
        title = TASKS[task][0]
        print_table(
            f"{title} accuracy after {args.steps} steps (mean ± std [min, max] over {len(seeds)} seed(s))",
            ["model", "params", *Ts],
            [[label(n), params[n], *(cell([r["final"] for r in of(task, n, T)]) for T in lengths)] for n in main_arms],
        )
        print_table(
            f"{title}: steps to {THRESHOLD:.0%} accuracy (mean ± std [min, max] over the seeds that reached it; "
            f"evaluated every {args.eval_every} steps)",
            ["model", *Ts],
            [[label(n), *(steps_cell(of(task, n, T)) for T in lengths)] for n in main_arms],
        )
    dt_arms = [n for n in ("kda", *ABLATION) if n in args.arms] if "mqar" in args.tasks else []
    T0 = lengths[0]
    if any(n in ABLATION for n in dt_arms):
        init = {"kda": "Kimi Linear's: softplus^-1(dt), dt ~ logU(1e-3, 1e-1)", **dict.fromkeys(ABLATION, "zeros")}
        print_table(
            f"KDA's dt_bias initialisation (MQAR, T={T0}, {len(seeds)} seed(s))",
            ["dt_bias init", "final accuracy", f"steps to {THRESHOLD:.0%}"],
            [[init[n], cell([r["final"] for r in of("mqar", n, T0)]), steps_cell(of("mqar", n, T0))] for n in dt_arms],
        )
    cpu = sum(r["cpu_seconds"] for r in runs)
    print(
        f"\n# {len(runs)} runs: {wall:.0f} s wall on {args.workers} worker(s), {cpu:.0f} s of CPU in the runs "
        f"(on idle cores about {cpu / args.workers / 60:.1f} min with {args.workers} worker(s))"
    )

    summary = {
        task: {
            n: {
                str(T): {
                    "final": spread([r["final"] for r in of(task, n, T)]),
                    "step_to_threshold": [r["step_to_threshold"] for r in of(task, n, T)],
                }
                for T in lengths_of(task, n)
            }
            for n in args.arms
            if lengths_of(task, n)
        }
        for task in args.tasks
    }
    setup = {
        "tasks": {
            task: {"title": TASKS[task][0], "size": {str(T): task_size(args, task, T) for T in lengths}}
            for task in args.tasks
        },
        "keys": N_KEYS,
        "values": N_VALUES,
        "noise_tokens": N_NOISE,
        "vocab": VOCAB,
        "lengths": lengths,
        "batch_tokens": args.batch_tokens,
        "seeds": seeds,
        "optimizer": "AdamW (betas 0.9, 0.98; weight decay 0.1 on matrices; 5% warm-up, cosine to 10%; clip 1)",
        "threshold": THRESHOLD,
        "quick": args.quick,
        "workers": args.workers,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "arms": {
            n: {
                "label": label(n),
                "layer_types": ALL_ARMS[n][1],
                "gate": ALL_ARMS[n][2],
                "dt_bias_init": ALL_ARMS[n][3],
            }
            for n in args.arms
        },
        "params": params,
        **common,
    }
    write_results(args.out, {"claim": "recall", "setup": setup, "summary": summary, "runs": runs})
    print(f"results: {os.path.join(args.out, 'results.json')}")

    # one row of panels a task (a panel a length; MQAR's row ends with the dt_bias panel)
    grid = [[(f"{TASKS[task][0]}, T={T}", task, T, main_arms) for T in lengths if main_arms] for task in args.tasks]
    if any(n in ABLATION for n in dt_arms):
        grid[args.tasks.index("mqar")].append((f"MQAR: KDA's dt_bias init, T={T0}", "mqar", T0, dt_arms))
    grid = [row for row in grid if row]
    columns = max((len(row) for row in grid), default=0)

    def draw(fig):
        for r, row in enumerate(grid):
            for c, (title, task, T, names) in enumerate(row):
                ax = fig.add_subplot(len(grid), columns, r * columns + c + 1)
                for n in names:
                    curves = [run["curve"] for run in of(task, n, T)]
                    steps = [s for s, _ in curves[0]]
                    by_step = list(zip(*([a for _, a in curve] for curve in curves)))
                    (line,) = ax.plot(steps, [sum(a) / len(a) for a in by_step], marker=".", ms=3, label=label(n))
                    low, high = [min(a) for a in by_step], [max(a) for a in by_step]
                    ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, lw=0)
                ax.axhline(THRESHOLD, color="gray", lw=0.5, ls="--")
                ax.set(xlabel="step", ylabel="accuracy" if c == 0 else None, title=title, ylim=(0, 1.02))
                ax.legend(fontsize=7, loc="upper left")

    if grid:
        save_plot(os.path.join(args.out, "recall.png"), draw, figsize=(4.2 * columns, 3.8 * len(grid)))


if __name__ == "__main__":
    sys.exit(main())
