"""Optimizer step time: MuonClip vs torch.optim.Muon + torch.optim.AdamW on the same parameters
(a dense hybrid model, since torch's Muon takes 2-D matrices only), CPU, fp32 parameters.
torch.optim.Muon always runs Newton-Schulz in bf16, which CPUs execute slowly: expect seconds per step.

    python benchmarks/optimizer_step.py            # hidden 128 and 256

The spread of the repeats is printed; a WARNING line says when it is too large to trust the ratios.
"""

from __future__ import annotations

import os
import sys

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import argument_parser, spread_cell, spread_warning, timed, warn  # noqa: E402

from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig  # noqa: E402
from kimi_hf.optim import MuonClip, split_params  # noqa: E402


def model_of(hidden: int):
    torch.manual_seed(0)
    cfg = KimiHybridTextConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=4,
        mlp_layer_types=["dense"] * 4,
        num_attention_heads=4,
        kv_lora_rank=hidden // 2,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_heads=4,
        linear_head_dim=hidden // 4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = KimiHybridForCausalLM(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--hidden", type=int, nargs="+", default=[128, 256], help="hidden sizes of the model")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per optimizer after a warm-up")
    args = p.parse_args(argv)
    print(
        f"# optimizer step, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print("# spread: interquartile range / median of the repeats, the worst of the row ('!': too noisy to compare)")
    print(
        "| hidden | params | Muon matrices | MuonClip ms | MuonClip (bf16 NS) ms | torch Muon + AdamW ms | spread "
        "| ratio | ratio (bf16 NS) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    times = {}
    for hidden in args.hidden:
        model = model_of(hidden)
        muon, adamw = split_params(model)
        ours = MuonClip.from_model(model, lr=1e-3, qk_clip_tau=None)
        ours_bf16 = MuonClip.from_model(model, lr=1e-3, qk_clip_tau=None, ns_dtype=torch.bfloat16)
        t_muon = torch.optim.Muon(muon, lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        t_adamw = torch.optim.AdamW(adamw, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

        def torch_step():
            t_muon.step()
            t_adamw.step()

        a, b, c = timed(ours.step, args.repeats), timed(ours_bf16.step, args.repeats), timed(torch_step, args.repeats)
        n = sum(q.numel() for q in model.parameters())
        times.update({f"hidden {hidden} MuonClip": a, f"hidden {hidden} bf16 NS": b, f"hidden {hidden} torch": c})
        print(
            f"| {hidden} | {n / 1e6:.1f}M | {len(muon)} | {a.ms:.1f} | {b.ms:.1f} | {c.ms:.1f} "
            f"| {spread_cell(a, b, c)} | {a.median / c.median:.2f}x | {b.median / c.median:.2f}x |",
            flush=True,
        )
    warn(spread_warning(times))


if __name__ == "__main__":
    main()
