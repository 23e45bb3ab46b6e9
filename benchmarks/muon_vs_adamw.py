"""Token efficiency: MuonClip vs AdamW on the same small byte-level hybrid LM, same init, same data
order (the Python standard library's sources, offline), each at its own learning rate.

    python benchmarks/muon_vs_adamw.py                       # 1000 steps each, plot to outputs/
    python benchmarks/muon_vs_adamw.py --sweep 200           # first pick each lr by a 200-step sweep
    python benchmarks/muon_vs_adamw.py --steps 300 --quick

Prints validation loss vs step for both, and the first step at which MuonClip's validation loss is at
or below AdamW's final one (target: <= half of AdamW's steps).
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import Timing, argument_parser, save_plot, spread_cell, spread_warning, warn  # noqa: E402

from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig  # noqa: E402
from kimi_hf.data import BOS_ID, EOS_ID, PAD_ID, ByteCorpus  # noqa: E402
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types  # noqa: E402
from kimi_hf.optim import MuonClip  # noqa: E402


def config(hidden=96):
    return KimiHybridTextConfig(
        vocab_size=259,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=3,
        layer_types=kimi_linear_layer_types(3),  # KDA, KDA, MLA (the last layer is MLA)
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_attention_heads=2,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=24,
        num_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_num_heads=2,
        linear_head_dim=hidden // 2,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        use_cache=False,
    )


def make_optimizer(name, model, lr):
    if name == "adamw":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), weight_decay=0.1
        )
    return MuonClip.from_model(model, lr=lr, weight_decay=0.1, qk_clip_tau=100.0)


@torch.no_grad()
def val_loss(model, corpus, args, batches=8):
    model.eval()
    losses = [
        model(input_ids=(x := corpus.batch(i, args.batch, args.seq, split="val")), labels=x).loss.item()
        for i in range(batches)
    ]
    model.train()
    return sum(losses) / len(losses)


def run(name, lr, steps, corpus, args, eval_every):
    """(step, val loss) every eval_every steps, and the Timing of the training steps (evaluation excluded)."""
    torch.manual_seed(args.seed)
    model = KimiHybridForCausalLM(config(args.hidden)).train()
    opt = make_optimizer(name, model, lr)
    warmup = max(1, steps // 20)
    decay = (
        (lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
        if args.schedule == "cosine"
        else (lambda s: 1.0)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * decay(s))
    curve, times = [], []
    for step in range(1, steps + 1):
        x = corpus.batch(step, args.batch, args.seq, seed=args.seed)
        t0 = time.perf_counter()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step % eval_every == 0 or step == steps:
            curve.append((step, val_loss(model, corpus, args)))
    return curve, Timing(tuple(times))


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--lr-adamw", type=float, default=3e-3)
    p.add_argument("--lr-muon", type=float, default=1e-2)
    p.add_argument("--sweep", type=int, default=0, help="steps of an lr sweep (x0.3, x1, x3) before the runs")
    p.add_argument(
        "--muon-steps",
        type=int,
        default=None,
        help="also train MuonClip with its own (cosine) schedule over this many steps, e.g. steps / 2",
    )
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--schedule", choices=["constant", "cosine"], default="cosine", help="after a 5%% warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/muon_vs_adamw.png")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    corpus = ByteCorpus(max_bytes=3_000_000)
    n_params = sum(q.numel() for q in KimiHybridForCausalLM(config(args.hidden)).parameters())
    print(
        f"# byte-level hybrid LM, {n_params / 1e6:.2f}M params, batch {args.batch} x {args.seq}, "
        f"{args.steps} steps, {args.schedule} lr, stdlib sources ({len(corpus.train) / 1e6:.1f}M train bytes)"
    )
    lrs = {"adamw": args.lr_adamw, "muonclip": args.lr_muon}
    if args.sweep:
        for name in lrs:
            results = {
                lr: run(name, lr, args.sweep, corpus, args, args.sweep)[0][-1][1]
                for lr in (lrs[name] * 0.3, lrs[name], lrs[name] * 3)
            }
            lrs[name] = min(results, key=results.get)
            print(
                f"sweep {name}: "
                + ", ".join(f"lr {lr:.2g} -> {v:.3f}" for lr, v in results.items())
                + f"; using {lrs[name]:.2g}"
            )
    curves, times = {}, {}
    for name, lr in lrs.items():
        curves[name], times[name] = run(name, lr, args.steps, corpus, args, args.eval_every)
    print("\n| step | AdamW val loss | MuonClip val loss |")
    print("|---|---|---|")
    for (s, a), (_, m) in zip(curves["adamw"], curves["muonclip"]):
        print(f"| {s} | {a:.4f} | {m:.4f} |")
    final = curves["adamw"][-1][1]
    if args.muon_steps:
        short, _ = run("muonclip", lrs["muonclip"], args.muon_steps, corpus, args, args.eval_every)
        print(
            f"\nMuonClip with its own {args.muon_steps}-step schedule: final val loss {short[-1][1]:.4f} "
            f"vs AdamW's {final:.4f} after {args.steps} steps "
            f"({'reached' if short[-1][1] <= final else 'not reached'} with {args.steps / args.muon_steps:.1f}x fewer steps)"
        )
    reach = next((s for s, v in curves["muonclip"] if v <= final), None)
    print(
        f"\nAdamW (lr {lrs['adamw']:.2g}) final val loss {final:.4f} at step {args.steps}; MuonClip (lr {lrs['muonclip']:.2g}) "
        f"reaches it at step {reach} ({'n/a' if reach is None else f'{args.steps / reach:.2f}x fewer steps'}); "
        f"training time AdamW {sum(times['adamw'].times):.0f}s, MuonClip {sum(times['muonclip'].times):.0f}s"
    )
    print(
        f"s/step: AdamW {times['adamw'].median:.3f}, MuonClip {times['muonclip'].median:.3f} (median; spread "
        f"{spread_cell(times['adamw'], times['muonclip'])}, interquartile range / median)"
    )
    warn(spread_warning({"AdamW steps": times["adamw"], "MuonClip steps": times["muonclip"]}, "step times"))

    def draw(fig):
        ax = fig.add_subplot()
        for name, curve in curves.items():
            ax.plot(*zip(*curve), label=f"{name} (lr {lrs[name]:.2g})")
        ax.axhline(final, color="gray", lw=0.5, ls="--")
        ax.set(
            xlabel="step",
            ylabel="validation loss (nats / byte)",
            title="MuonClip vs AdamW, byte-level hybrid LM on stdlib sources",
        )
        ax.legend()

    save_plot(args.out, draw)


if __name__ == "__main__":
    main()
