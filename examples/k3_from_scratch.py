"""Train a small Kimi K3-architecture model from scratch with MuonClip through transformers' Trainer, on the
Python standard library's sources (byte level, offline, CPU), save it in Kimi K3's released layout (MXFP4
experts), reload it through the Auto classes and generate.

    python examples/k3_from_scratch.py                  # about 2-3 minutes on 2 CPU cores
    python examples/k3_from_scratch.py --steps 40 --out /tmp/k3

Every K3 component is on: safe-gate KDA with the full-rank output gate, gated MLA with q LoRA, SiTU-GLU FFNs,
Stable LatentMoE (latent routed experts, shared experts on the full hidden), Block Attention Residuals counted
in layers, the MoonViT3d tower and patchmergerv2 projector (built and saved; this text-only run does not
train them). Writes <out>/k3_loss.png (kimi_hf.plotting: Pillow only) and <out>/model (K3's released names).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import kimi_hf  # noqa: F401  (registers the Auto classes)
from kimi_hf import KimiK3ForConditionalGeneration
from kimi_hf.cli_args import ArgumentParser, check_output_folder, check_positive
from kimi_hf.data import BOS_ID, EOS_ID, PAD_ID, ByteCorpus
from kimi_hf.optim import MuonClip, MuonClipCallback
from kimi_hf.plotting import LossHistory, save_loss_plot
from kimi_hf.presets import small_k3_config


class Windows(Dataset):
    """Byte windows of the corpus as Trainer examples (input_ids = labels)."""

    def __init__(self, corpus: ByteCorpus, n: int, seq: int, seed: int):
        self.rows = corpus.batch(0, n, seq, seed=seed)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def check_args(args) -> None:
    """Bad input, found before any work (ValueError / OSError naming the argument)."""
    check_positive(args, "steps", "batch", "seq", "hidden")
    check_positive(args, "lr", number="number")
    check_output_folder(args.out)


def main(argv=None):
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/k3_from_scratch")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))

    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    # byte-level vocabulary of 259: bytes, then BOS / EOS / PAD (PAD doubles as the unused image slot)
    config = small_k3_config(args.hidden, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model = KimiK3ForConditionalGeneration(config)
    n = sum(p.numel() for p in model.parameters())
    print(f"K3-architecture model: {n / 1e6:.2f}M parameters ({model.config.text_config.num_hidden_layers} layers)")
    corpus = ByteCorpus(max_bytes=1_000_000)
    history = LossHistory()
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        logging_steps=max(1, min(10, args.steps // 10)),
        report_to=[],
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Windows(corpus, args.steps * args.batch, args.seq, args.seed),
        optimizer_cls_and_kwargs=(MuonClip, dict(model=model, lr=args.lr, weight_decay=0.01, qk_clip_tau=100.0)),
        callbacks=[history, MuonClipCallback()],
    )
    trainer.train()
    plot = save_loss_plot(
        os.path.join(args.out, "k3_loss.png"), history.steps, history.losses, title="K3 architecture: training loss"
    )
    print(f"loss {history.losses[0]:.3f} -> {history.losses[-1]:.3f}; loss plot: {plot}")

    folder = os.path.join(args.out, "model")
    # Kimi K3's released names and shapes; experts as dense tensors (exact; experts_format="mxfp4" re-packs them as
    # the release does, rounding trained weights to the MXFP4 grid)
    model.save_pretrained(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([[BOS_ID, *b"def "]])
    with torch.no_grad():
        out = reloaded.generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
        same = torch.equal(
            out,
            model.eval().generate(prompt, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID),
        )
    text = bytes(t for t in out[0, 1:].tolist() if t < 256).decode("utf-8", errors="replace")
    print(f"saved (released K3 layout) and reloaded: {folder}; same greedy tokens as before saving: {same}")
    print(f"generated: {text!r}")
    return history.losses, same


if __name__ == "__main__":
    main()
