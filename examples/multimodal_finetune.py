"""Train the early-fusion model (MoonViT tower + hybrid KDA/MLA decoder) to count circles in
generated scenes, with transformers' Trainer, MuonClip and the vision collator; CPU, offline.

    python examples/multimodal_finetune.py                    # about 5 minutes on 2 CPU cores
    python examples/multimodal_finetune.py --steps 50 --eval 32 --out /tmp/mm

Scenes hold 1-4 circles and up to 2 distracting squares; the model must answer "How many circles
are there?" from the pixels (chance: 25%). Prints the held-out accuracy (greedy generate on images
never seen in training) and the accuracy per count, writes the loss curve to <out>/multimodal.png
(kimi_hf.plotting's PNG writer: no matplotlib needed) and the model and processor to <out>/model.
The accuracy depends on --seed (data, initialisation, batch order), and on the machine's kernels.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import Trainer, TrainingArguments

from kimi_hf import KimiHybridConfig, KimiHybridForConditionalGeneration, KimiHybridImageProcessor, KimiHybridProcessor
from kimi_hf.chat import IMAGE_TOKEN, chat_stop_token_ids
from kimi_hf.cli_args import ArgumentParser, check_output_folder, check_positive
from kimi_hf.collators import KimiHybridVisionCollator
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types
from kimi_hf.optim import MuonClip, MuonClipCallback
from kimi_hf.plotting import LossHistory, save_loss_plot
from kimi_hf.scenes import counting_accuracy, counting_examples
from kimi_hf.tokenization import train_tokenizer


def build(tokenizer, hidden: int, vision_hidden: int, image_size: int) -> KimiHybridForConditionalGeneration:
    side = image_size // 14 + 1
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=2,
        layer_types=kimi_linear_layer_types(2),  # KDA, MLA (the last layer is MLA)
        mlp_layer_types=["dense", "sparse"],
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
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=chat_stop_token_ids(tokenizer),
    )  # replies stop at the turn end
    vision = dict(
        hidden_size=vision_hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * vision_hidden,
        pos_emb_height=side,
        pos_emb_width=side,
    )
    config = KimiHybridConfig(
        text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    )
    return KimiHybridForConditionalGeneration(config)


def check_args(args) -> None:
    """Bad input, found before any work (ValueError / OSError naming the argument)."""
    check_positive(args, "train", "eval", "steps", "batch", "hidden", "vision_hidden", "image_size")
    if args.batch > args.train:  # the Trainer drops the last partial batch: no batch at all
        raise ValueError(f"--batch ({args.batch}) must not exceed --train ({args.train})")
    check_positive(args, "lr", number="number")
    check_output_folder(args.out)


def main(argv=None) -> float:
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", type=int, default=6000, help="training scenes")
    p.add_argument("--eval", type=int, default=256, help="held-out scenes")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--vision-hidden", type=int, default=64)
    p.add_argument("--image-size", type=int, default=84)
    p.add_argument("--seed", type=int, default=0, help="data, initialisation and batch order (the accuracy varies)")
    p.add_argument("--out", default="outputs/multimodal")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)

    train = counting_examples(args.train, seed=args.seed, size=args.image_size)
    held_out = counting_examples(args.eval, seed=args.seed + 10_000, size=args.image_size)
    tokenizer = train_tokenizer(
        [f"{ex['messages'][0]['content'][1]['text']} {ex['answer']}" for ex in train[:500]], vocab_size=300
    )
    processor = KimiHybridProcessor(KimiHybridImageProcessor(), tokenizer)
    model = build(tokenizer, args.hidden, args.vision_hidden, args.image_size)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; {args.train} training scenes, {args.eval} held-out")

    history = LossHistory()
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "trainer"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        logging_steps=max(1, min(10, args.steps // 10)),  # a loss curve even for few steps
        report_to=[],
        remove_unused_columns=False,
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        seed=args.seed,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=train,
        data_collator=KimiHybridVisionCollator(processor),
        optimizer_cls_and_kwargs=(MuonClip, dict(model=model, lr=args.lr, weight_decay=0.01, qk_clip_tau=100.0)),
        callbacks=[history, MuonClipCallback()],
    )
    trainer.train()

    acc, per_count = counting_accuracy(model, processor, held_out)
    chance = 1 / len(per_count)
    print("\n| circles | held-out accuracy |\n|---|---|")
    for k, v in per_count.items():
        print(f"| {k} | {v:.2f} |")
    print(
        f"\nheld-out accuracy {acc:.3f} (seed {args.seed}; chance {chance:.2f}) on {len(held_out)} scenes never "
        "seen in training"
    )
    # the package's own PNG writer (Pillow only): matplotlib is an optional extra
    path = save_loss_plot(
        os.path.join(args.out, "multimodal.png"),
        history.steps,
        history.losses,
        title=f"training loss (answer tokens); held-out accuracy {acc:.3f}, seed {args.seed}",
    )
    print(f"loss plot: {path}")
    model.save_pretrained(os.path.join(args.out, "model"))
    processor.save_pretrained(os.path.join(args.out, "model"))
    print(f"model and processor: {os.path.join(args.out, 'model')}")
    return acc


if __name__ == "__main__":
    main()
