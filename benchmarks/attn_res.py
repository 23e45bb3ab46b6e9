"""Block Attention Residuals vs the residual sum, side by side on real text (the Python standard
library's sources, byte level, offline): same initial weights (the AttnRes extras start at zero
queries / unit key norms), same data order, same optimizer and schedule.

    python benchmarks/attn_res.py                      # 8 layers (16 sublayers), blocks of 4, 300 steps
    python benchmarks/attn_res.py --steps 50 --out /tmp/ar

Prints validation loss during training, the per-depth RMS of each sublayer's input (the hidden state
a sublayer reads), per-layer gradient norms, the median time per step (overhead), and writes the
learned depth-attention weights as a heatmap (plus the RMS curves) to <out>/attn_res.png. The step
times print the spread of their repeats; a WARNING line says when it is too large to trust the overhead.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time


sys.modules.setdefault("fla", None)

import torch  # noqa: E402


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import Timing, argument_parser, save_plot, spread_cell, spread_warning, warn  # noqa: E402

from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig  # noqa: E402
from kimi_hf.data import BOS_ID, EOS_ID, PAD_ID, ByteCorpus  # noqa: E402


def config(args, mode: str) -> KimiHybridTextConfig:
    h = args.hidden
    return KimiHybridTextConfig(
        vocab_size=259,
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h,
        num_hidden_layers=args.layers,
        mlp_layer_types=["dense"] * args.layers,
        num_attention_heads=4,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_heads=4,
        linear_head_dim=h // 4,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        attn_residual=mode,
        attn_residual_block_size=args.block_size if mode == "block" else None,
    )


def sublayer_input_rms(model, x) -> list[float]:
    """RMS of the input of every sublayer's pre-norm (attention, then MLP, layer by layer)."""
    rms, hooks = [], []
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            hooks.append(
                norm.register_forward_pre_hook(lambda m, inp: rms.append(inp[0].float().pow(2).mean().sqrt().item()))
            )
    with torch.no_grad():
        model(x, use_cache=False)
    for h in hooks:
        h.remove()
    return rms


def depth_weights(model, x) -> torch.Tensor:
    """[sublayers + 1, max sources] mean depth-attention weights (rows: sublayers, then the final one)."""
    rows, hooks = [], []
    mods = [m for layer in model.model.layers for m in (layer.attn_res, layer.mlp_res)] + [model.model.final_res]
    for mod in mods:
        hooks.append(mod.register_forward_hook(lambda m, inp, out: rows.append(m.weights(*inp).mean((1, 2)))))
    with torch.no_grad():
        model(x, use_cache=False)
    for h in hooks:
        h.remove()
    out = torch.full((len(rows), max(len(r) for r in rows)), float("nan"))
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def layer_grad_norms(model, x) -> list[float]:
    model.zero_grad()
    model(x, labels=x, use_cache=False).loss.backward()
    norms = [
        math.sqrt(sum(p.grad.float().pow(2).sum().item() for p in layer.parameters() if p.grad is not None))
        for layer in model.model.layers
    ]
    model.zero_grad()
    return norms


def interleaved_step_times(models: dict, x, rounds: int) -> dict[str, Timing]:
    """Forward+backward times per model, alternating the models every round so that machine
    drift (frequency, other load) hits both alike."""
    times = {k: [] for k in models}
    for _ in range(rounds):
        for k, m in models.items():
            t0 = time.perf_counter()
            m(x, labels=x, use_cache=False).loss.backward()
            times[k].append(time.perf_counter() - t0)
            m.zero_grad()
    return {k: Timing(tuple(v)) for k, v in times.items()}


def train(model, corpus, args, label):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    val = [corpus.batch(i, args.batch, args.seq, split="val") for i in range(4)]
    times, curve = [], []
    model.train()
    for step in range(args.steps):
        x = corpus.batch(step, args.batch, args.seq, seed=args.seed)
        t0 = time.perf_counter()
        loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step % args.eval_every == 0 or step == args.steps - 1:
            model.eval()
            with torch.no_grad():
                v = statistics.mean(model(b, labels=b, use_cache=False).loss.item() for b in val)
            model.train()
            curve.append((step, v))
            print(f"{label:9s} step {step:4d} train {loss.item():.4f} val {v:.4f}", flush=True)
    return curve, Timing(tuple(times[len(times) // 5 :]))  # the first steps warm up


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--block-size", type=int, default=4, help="sublayers per block")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing-rounds", type=int, default=15, help="interleaved fwd+bwd timings after training")
    p.add_argument("--out", default="outputs/attn_res")
    args = p.parse_args(argv)
    torch.set_flush_denormal(True)
    corpus = ByteCorpus(max_bytes=2_000_000)
    torch.manual_seed(args.seed)
    base = KimiHybridForCausalLM(config(args, "none"))
    ar = KimiHybridForCausalLM(config(args, "block"))
    ar.load_state_dict(base.state_dict(), strict=False)  # same weights; AttnRes extras at their zero init
    probe = corpus.batch(0, 8, args.seq, split="val")
    results = {}
    for label, model in (("baseline", base), ("attn_res", ar)):
        curve, step_time = train(model, corpus, args, label)
        model.eval()
        results[label] = dict(
            curve=curve,
            step=step_time,
            rms=sublayer_input_rms(model, probe),
            grads=layer_grad_norms(model.train(), probe),
        )
    b, a = results["baseline"], results["attn_res"]
    steps = interleaved_step_times(
        {"baseline": base.train(), "attn_res": ar.train()},
        corpus.batch(1, args.batch, args.seq, seed=args.seed),
        args.timing_rounds,
    )
    n_blocks = -(-2 * args.layers // args.block_size)
    print(
        f"\n# {args.layers} layers ({2 * args.layers} sublayers), hidden {args.hidden}, blocks of {args.block_size} "
        f"sublayers ({n_blocks} blocks), {args.steps} steps, batch {args.batch} x {args.seq} bytes"
    )
    print(
        "\n| | final val loss | s/step in training | fwd+bwd s, interleaved | spread | overhead (interleaved) |\n"
        "|---|---|---|---|---|---|"
    )
    overhead = steps["attn_res"].median / steps["baseline"].median - 1
    print(
        f"| baseline | {b['curve'][-1][1]:.4f} | {b['step'].median:.3f} | {steps['baseline'].median:.3f} "
        f"| {spread_cell(b['step'], steps['baseline'])} | |"
    )
    print(
        f"| Block AttnRes | {a['curve'][-1][1]:.4f} | {a['step'].median:.3f} | {steps['attn_res'].median:.3f} "
        f"| {spread_cell(a['step'], steps['attn_res'])} | {100 * overhead:+.1f}% |"
    )
    print("(spread: interquartile range / median of the steps, the worst of the row; '!': too noisy to compare)")
    warn(
        spread_warning(
            {
                "baseline training steps": b["step"],
                "AttnRes training steps": a["step"],
                "baseline interleaved": steps["baseline"],
                "AttnRes interleaved": steps["attn_res"],
            },
            "step times",
        )
    )
    print("\n| sublayer | input RMS baseline | input RMS AttnRes |\n|---|---|---|")
    for s, (rb, ra) in enumerate(zip(b["rms"], a["rms"])):
        print(f"| {s} ({'attn' if s % 2 == 0 else 'mlp'}) | {rb:.3f} | {ra:.3f} |")
    print("\n| layer | grad norm baseline | grad norm AttnRes |\n|---|---|---|")
    for i, (gb, ga) in enumerate(zip(b["grads"], a["grads"])):
        print(f"| {i} | {gb:.4f} | {ga:.4f} |")
    cv = lambda g: statistics.pstdev(g) / statistics.mean(g)  # noqa: E731
    print(
        f"\ngrad-norm spread across layers (std / mean): baseline {cv(b['grads']):.2f}, AttnRes {cv(a['grads']):.2f}"
    )
    weights = depth_weights(ar.eval(), probe)

    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        im = ax1.imshow(weights.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax1.set(
            xlabel="source (0 = embedding, then blocks, then the partial sum)",
            ylabel="sublayer (last row: final)",
            title="learned depth-attention weights",
        )
        fig.colorbar(im, ax=ax1)
        ax2.plot(b["rms"], label="baseline (residual sum)")
        ax2.plot(a["rms"], label="Block AttnRes")
        ax2.set(xlabel="sublayer", ylabel="RMS of the sublayer input", title="hidden-state RMS by depth")
        ax2.legend()

    save_plot(os.path.join(args.out, "attn_res.png"), draw, figsize=(12, 4.5))
    return results


if __name__ == "__main__":
    main()
