"""QK-Clip at work: the same small hybrid LM trained with Muon at a high learning rate, with and
without clipping. Without it the MLA layer's max pre-softmax logit grows past tau; with it every head
stays at or below tau, and the loss does not suffer.

    python benchmarks/qk_clip.py                 # 300 steps, lr 0.05, tau 20; plot to outputs/
"""

from __future__ import annotations

import os
import sys

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import argument_parser, save_plot  # noqa: E402
from muon_vs_adamw import config  # noqa: E402

from kimi_hf import KimiHybridForCausalLM  # noqa: E402
from kimi_hf.data import ByteCorpus  # noqa: E402
from kimi_hf.optim import MuonClip  # noqa: E402


def run(clip: bool, args, corpus):
    torch.manual_seed(args.seed)
    cfg = config(args.hidden)
    cfg._attn_implementation = "eager"  # exact max logits
    model = KimiHybridForCausalLM(cfg).train()
    # without clipping, a tau no logit reaches still records the max logits
    opt = MuonClip.from_model(model, lr=args.lr, weight_decay=0.0, qk_clip_tau=args.tau if clip else float("inf"))
    rows = []
    for step in range(1, args.steps + 1):
        x = corpus.batch(step, args.batch, args.seq, seed=args.seed)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        rows.append((step, loss.item(), opt.qk_clip.last_max_logit, opt.qk_clip.total_clipped_heads))
    return rows


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--tau", type=float, default=20.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/qk_clip.png")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    corpus = ByteCorpus(max_bytes=2_000_000)
    runs = {"no clip": run(False, args, corpus), "QK-Clip": run(True, args, corpus)}
    print(
        f"# Muon lr {args.lr}, tau {args.tau}, {args.steps} steps: training loss and max pre-softmax logit (MLA layer)"
    )
    print(
        "| step | loss (no clip) | max logit (no clip) | loss (QK-Clip) | max logit (QK-Clip) | heads clipped so far |"
    )
    print("|---|---|---|---|---|---|")
    every = max(1, args.steps // 10)
    for a, b in zip(runs["no clip"], runs["QK-Clip"]):
        if a[0] % every == 0 or a[0] == 1:
            print(f"| {a[0]} | {a[1]:.3f} | {a[2]:.1f} | {b[1]:.3f} | {b[2]:.1f} | {b[3]} |")
    peak = {k: max(r[2] for r in v) for k, v in runs.items()}
    # the logit recorded during a step is clipped after it: from step 2 on, QK-Clip's never exceeds tau
    after_first = max(r[2] for r in runs["QK-Clip"][1:])
    last = min(20, args.steps)
    tail = {k: sum(r[1] for r in v[-last:]) / last for k, v in runs.items()}
    print(
        f"\npeak max logit: no clip {peak['no clip']:.1f}, QK-Clip {peak['QK-Clip']:.1f} (after step 1: {after_first:.1f}, "
        f"tau {args.tau}); mean loss of the last {last} steps: no clip {tail['no clip']:.3f}, QK-Clip {tail['QK-Clip']:.3f}"
    )

    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for name, rows in runs.items():
            steps = [r[0] for r in rows]
            ax1.plot(steps, [r[2] for r in rows], label=name)
            ax2.plot(steps, [r[1] for r in rows], label=name)
        ax1.axhline(args.tau, color="gray", ls="--", lw=0.8, label="tau")
        ax1.set(xlabel="step", ylabel="max pre-softmax logit", title="MLA max logit", yscale="log")
        ax2.set(xlabel="step", ylabel="training loss", title="loss")
        ax1.legend()
        ax2.legend()

    save_plot(args.out, draw, figsize=(11, 4))


if __name__ == "__main__":
    main()
