"""Kimi K3 with TRL's SFTTrainer and PEFT LoRA over the resident MXFP4 experts, on your chat data with tools, on one
process or sharded at load by transformers' DistributedConfig (expert parallelism over FSDP2's ranks) under torchrun
or accelerate launch.

    python examples/k3_sft_trl.py --model K3_DIR --data chats.jsonl                      # one process
    torchrun --nproc-per-node 2 examples/k3_sft_trl.py --model K3_DIR --data chats.jsonl --ep 2   # EP 2 x FSDP2 2
    accelerate launch --config_file examples/accelerate/cpu_ddp.yaml examples/k3_sft_trl.py ... --ep 2

The HF-native path (docs/parallelism.md, "TRL and Trainer on K3"): `from_pretrained(distributed_config=...)` shards
the model as it loads (transformers' FSDP2 over the data ranks, the routed experts over ep of them), PEFT adds the
adapters after it and transformers' Trainer keeps them replicated (broadcast at the start, gradients averaged);
SFTTrainer renders the chats with K3's template, trains on the assistant's tokens (`assistant_only_loss`, the
template's generation markers), packs documents into rows (`bfd`: each document's positions restart, which K3 reads
as document boundaries) and evaluates the held-out file. Rows with `images` (file paths, relative to the data file;
`{"type": "image"}` parts in the messages) go through K3's processor and TRL's vision collator instead, unpacked.
Pipeline stages, tensor parallelism with LoRA and context parallelism are the library trainer's (`kimi-hf finetune`);
accelerate's context parallelism shards SDPA only.

Rank 0 prints one JSON line per step, {"step": i, "loss": x}, and per evaluation, {"step": i, "eval_loss": x}.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kimi_hf.cli_args import ArgumentParser, check_positive, one_line
from kimi_hf.finetune.data import load_sft_rows
from kimi_hf.model_folder import check_model_folder


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked before any model is built: a bad one (or a bad file, row or field of the data) is one line
    `k3_sft_trl.py: error: ...`, exit status 2."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a Kimi K3 folder (released layout, MXFP4 experts kept resident)")
    p.add_argument("--data", required=True, help="a .jsonl / .json / .parquet file in TRL's formats")
    p.add_argument("--eval-data", help="held-out rows, evaluated every --eval-every steps")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (tiling FSDP2's data ranks)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="packed rows a step, over all data ranks")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens a packed row")
    p.add_argument("--optimizer", choices=("muonclip", "adamw"), default="muonclip")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument(
        "--dtype", choices=("auto", "bfloat16", "float32", "float64"), default="auto", help="auto: bf16 on CUDA"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="outputs/k3_sft_trl", help="the Trainer's output folder")
    p.add_argument("--save-adapter", help="write the trained adapter here in K3's released module names")
    args = p.parse_args(argv)
    try:
        check_args(args, int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, TypeError, OSError) as e:
        p.error(one_line(e))
    return args


def check_args(args, world: int) -> None:
    check_positive(args, "steps", "batch", "seq_len", "lora_rank", "ep")
    check_positive(args, "lr", number="number")
    if args.eval_every < 0:
        raise ValueError(f"--eval-every must be 0 (at the end) or positive, got {args.eval_every}")
    check_model_folder(args.model, what="--model", model_types=("kimi_k3",))
    if world % args.ep:
        raise ValueError(f"--ep {args.ep} does not divide the {world} ranks (FSDP2's data ranks, which it tiles)")
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} is not a multiple of the {world} ranks (rows a step, over them all)")
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path is not None:
            if not path.endswith((".json", ".jsonl", ".parquet")):
                raise ValueError(f"{flag} {path!r}: give a .jsonl, .json or .parquet file")
            load_sft_rows(path)  # every row in TRL's formats (the file, row and field named)


class JsonLines:
    """A TrainerCallback printing rank 0's losses as JSON lines (the step counted from 0, as `kimi-hf finetune`)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Printer(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if not state.is_world_process_zero or not logs:
                    return
                for key in ("loss", "eval_loss"):
                    if key in logs:
                        print(json.dumps({"step": state.global_step - 1, key: float(logs[key])}), flush=True)

        return _Printer()


def with_images(split, folder: str):
    """The split's `images` (file paths, relative ones under `folder`) as decoded PIL images (datasets' Image)."""
    from datasets import Image, Sequence

    def absolute(row):
        return {"images": [p if os.path.isabs(p) else os.path.join(folder, p) for p in row["images"] or []]}

    return split.map(absolute).cast_column("images", Sequence(Image()))


def main(argv=None) -> None:
    args = parse_args(argv)
    from datasets import load_dataset
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer, PrinterCallback
    from transformers.distributed import DistributedConfig
    from trl import SFTConfig, SFTTrainer

    import kimi_hf
    from kimi_hf.adapters_released import save_released_adapter
    from kimi_hf.optim import MuonClip

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = kimi_hf.KimiK3Config.from_pretrained(args.model)
    # several ranks: transformers shards at load, FSDP2 over every rank and the experts over ep of them
    sharded = DistributedConfig(ep_size=args.ep, fsdp_size=world) if world > 1 else None
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if torch.cuda.is_available() else "float32")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, dtype), distributed_config=sharded)
    torch.manual_seed(args.seed)  # the adapters' draw: the same on every rank (and the Trainer broadcasts rank 0's)
    model = get_peft_model(model, kimi_hf.lora_config(config, args.lora_rank))
    files = {"train": args.data, **({"eval": args.eval_data} if args.eval_data else {})}
    data = load_dataset("parquet" if args.data.endswith(".parquet") else "json", data_files=files)
    # rows with images: K3's processor renders them (each image's patches at its placeholder) and TRL's vision
    # collator batches them unpacked; image paths are relative to their data file
    images = "images" in data["train"].column_names
    if images:
        for split, path in files.items():
            data[split] = with_images(data[split], os.path.dirname(os.path.abspath(path)))
    evaluating = args.eval_data is not None
    sft = SFTConfig(
        output_dir=args.out,
        max_steps=args.steps,
        # one packed row a forward (TRL's padding-free collator joins a batch's rows into one): the same shapes in
        # every layout, the rows of a step accumulated
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.batch // world,
        per_device_eval_batch_size=1,  # Trainer averages the batches' mean losses: one packed row a batch, any world
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        max_grad_norm=args.max_grad_norm,
        max_length=args.seq_len,
        packing=not images,
        packing_strategy="bfd",
        assistant_only_loss=True,
        eval_strategy="steps" if evaluating else "no",
        eval_steps=args.eval_every or args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataset_num_proc=None,
    )
    trainer = SFTTrainer(
        model=model,
        args=sft,
        train_dataset=data["train"],
        eval_dataset=data["eval"] if evaluating else None,
        processing_class=(AutoProcessor if images else AutoTokenizer).from_pretrained(args.model),
        callbacks=[JsonLines()],
        # MuonClip over the trainable parameters by role (Muon on the adapters' matrices); its Newton-Schulz work is
        # shared over the ranks, which all hold the adapters
        optimizer_cls_and_kwargs=(MuonClip, {"model": model, "lr": args.lr}) if args.optimizer == "muonclip" else None,
    )
    trainer.remove_callback(PrinterCallback)  # stdout holds the JSON lines only (the progress bar is off)
    trainer.train()
    if args.save_adapter:  # every rank calls it (as save_pretrained): rank 0 writes
        save_released_adapter(trainer.model, args.save_adapter, overwrite=True)


if __name__ == "__main__":
    main()
