"""Pre-train a small hybrid KDA/MLA model with MuonClip under accelerate, on the Python standard
library's sources (byte level, offline).

    python examples/pretrain_muonclip.py --steps 200                      # one process (CPU or GPU)
    accelerate launch --num_processes 2 examples/pretrain_muonclip.py     # multi-GPU
    torchrun --nproc_per_node 2 examples/pretrain_muonclip.py             # multi-process on CPU (gloo)

Every rank takes its rows of the same global batch, so a distributed run follows the single-process
run (same losses, same weights); MuonClip splits the Newton-Schulz work across ranks and all-reduces
the per-head max logits before QK-Clip.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
from accelerate import Accelerator

from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig
from kimi_hf.cli_args import ArgumentParser, check_output_folder, check_positive
from kimi_hf.data import BOS_ID, EOS_ID, PAD_ID, ByteCorpus
from kimi_hf.optim import MuonClip


def small_config(hidden: int = 64, layers: int = 4) -> KimiHybridTextConfig:
    return KimiHybridTextConfig(
        vocab_size=259,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_num_heads=2,
        linear_head_dim=hidden // 2,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )


def check_args(args) -> None:
    """Bad input, found before any work (ValueError / OSError naming the argument)."""
    check_positive(args, "steps", "batch", "seq", "hidden", "corpus_bytes")
    check_positive(args, "lr", "qk_clip_tau", number="number")
    check_output_folder(args.out)


def main(argv=None):
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="global batch (split across processes)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--qk-clip-tau", type=float, default=100.0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--out", default=None, help="save the model and the loss history here")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    model = KimiHybridForCausalLM(small_config(args.hidden))
    opt = MuonClip.from_model(model, lr=args.lr, weight_decay=0.1, qk_clip_tau=args.qk_clip_tau)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    # the scheduler is not prepared: accelerate would step it once per process, but here every
    # process takes its share of one global batch
    model, opt = accelerator.prepare(model, opt)
    corpus = ByteCorpus(max_bytes=args.corpus_bytes)
    rank, world = accelerator.process_index, accelerator.num_processes
    losses = []
    model.train()
    for step in range(args.steps):
        x = corpus.batch(step, args.batch, args.seq, seed=args.seed, rank=rank, world=world).to(accelerator.device)
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
        losses.append(mean_loss)
        inner = opt.optimizer if hasattr(opt, "optimizer") else opt
        if accelerator.is_main_process and (step % 20 == 0 or step == args.steps - 1):
            qk = inner.qk_clip
            print(
                f"step {step:4d} loss {mean_loss:.4f} max_logit {qk.last_max_logit or float('nan'):.2f} "
                f"clipped {qk.total_clipped_heads}",
                flush=True,
            )
    print(f"rank {rank}: orthogonalised {inner.ns_matrices} matrices per step", flush=True)
    if args.out and accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        accelerator.unwrap_model(model).save_pretrained(args.out)
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    accelerator.wait_for_everyone()
    return losses


if __name__ == "__main__":
    main()
