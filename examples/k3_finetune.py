"""Fine-tune Kimi K3 (or Kimi Linear) on any layout of ranks: LoRA over the resident MXFP4 experts or full
fine-tuning, MuonClip or AdamW, pipeline stages (Attention Residuals across the boundary), FSDP2, tensor / expert
parallelism, context parallelism (--cp), sharded checkpoints to resume from.

    python examples/k3_finetune.py --model DIR --lora --steps 4 --data random                  # one process
    torchrun --nproc-per-node 4 examples/k3_finetune.py --model DIR --lora --pp 2 --ep 2       # 4 ranks
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT examples/k3_finetune.py ...
    accelerate launch --config_file examples/accelerate/cpu_k3_finetune.yaml examples/k3_finetune.py ...

Rank 0 prints one JSON line per optimizer step, {"step": i, "loss": x}, and nothing else on stdout (errors: one
line on stderr, exit status 2; what is refused before the process group starts is printed once: a bad --model folder,
a layout, with the flag that makes it run, the batch, --data, --resume, --export). A step trains on the same global
batch in every layout, --micro-batch sequences of --seq-len tokens times --micro-batches (default 4), split over the
data ranks (dp_replicate x fsdp = world / (pp x tp); --fsdp left out is all of them, or 1 under --tp, the rest
replicating: kimi_hf.distributed.ParallelDims; with --cp C, every C consecutive data ranks split each sequence
instead: kimi_hf.distributed.context), so the same seed and data give the same losses on any layout (to rounding).
--data random draws seeded token ids below the config's vocab_size (a folder without a tokenizer; the image
placeholder id left out); --data stdlib tokenizes the Python standard library's sources with the folder's tokenizer.
--export DIR writes the trained model in K3's released layout from the last checkpoint, streaming (LoRA: merged into
the source folder's weights); an existing DIR is refused before training starts unless --overwrite is given (it is
then replaced once the new folder is complete).

--checkpoint-dir D saves a sharded checkpoint (torch.distributed.checkpoint) at the end (and every --save-every
steps): model (LoRA: the adapters), optimizer states, scheduler, step. --resume continues from D's latest step,
also on another layout (DCP reshards), with the same losses as an uninterrupted run. See docs/parallelism.md.
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Kimi K3 / Kimi Linear model folder (config.json + weights)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", action="store_true", help="LoRA adapters, the base frozen (the default)")
    mode.add_argument("--full", action="store_true", help="full fine-tuning (experts loaded dense)")
    p.add_argument("--optimizer", choices=("muonclip", "adamw"), default="muonclip")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences a micro-batch")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches a step (over all data ranks)")
    p.add_argument("--data", choices=("stdlib", "random"), default="stdlib")
    for name in ("tp", "ep", "pp", "cp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--fsdp", type=int, default=None, help="FSDP2 shards (default: the data ranks the others leave)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="the pipeline schedule")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--qk-clip-tau", type=float, default=100.0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each layer in the backward")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir's latest step")
    p.add_argument(
        "--export", metavar="DIR", help="at the end, the trained model in K3's released layout (LoRA: merged)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --export DIR")
    args = p.parse_args(argv)
    args.lora = not args.full
    for name in ("steps", "seq_len", "micro_batch", "micro_batches", "lora_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.export and not args.checkpoint_dir:
        p.error("--export needs --checkpoint-dir: the export streams the trained weights from the sharded checkpoint")
    return args


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    # refused before the process group starts, alike on every rank: printed once (the folders: once a node)
    try:
        config = check_files(args)
    except (ValueError, TypeError, OSError) as e:
        refuse(e, printer="LOCAL_RANK")
    try:
        layout = check_layout(args, config, int(os.environ.get("WORLD_SIZE", "1")))
    except (ValueError, TypeError, OSError) as e:
        refuse(e, printer="RANK")
    try:
        return run(args, config, layout)
    except (ValueError, TypeError, OSError) as e:
        refuse(e)


def refuse(error: Exception, printer: str | None = None):
    """One line on stderr, exit status 2, printed once (kimi_hf.cli_args.refuse)."""
    from kimi_hf.cli_args import refuse

    refuse(error, "k3_finetune", printer)


def check_files(args):
    """The folders, before any expensive work (kimi_hf.finetune.cli.check_folders: --model, --resume's checkpoint,
    the --export folder rank 0 will write), and a tokenizer for --data stdlib. Returns the model's config."""
    from kimi_hf.finetune.cli import check_folders

    config = check_folders(args)
    if args.data == "stdlib" and not any(
        os.path.isfile(os.path.join(args.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        raise ValueError(f"--data stdlib needs a tokenizer in --model {args.model}; use --data random")
    return config


def check_layout(args, config, world: int):
    """The layout of the flags on `world` ranks, refused with the flag that makes it run, and the batch over the data
    ranks (kimi_hf.finetune.cli.check_layout). Returns the ParallelDims."""
    from kimi_hf.finetune.cli import check_layout

    return check_layout(args, config, world, args.schedule)


# ---- data and the loop -------------------------------------------------------------------------------------------
def batches(args, config):
    """The global batch of each step (kimi_hf.finetune.batches): the same in every layout."""
    from kimi_hf.finetune.batches import RandomTokens, StdlibTokens

    if args.data == "random":  # the image placeholder left out: a text batch would ask for pixels
        image = getattr(config, "image_token_id", None)
        return RandomTokens(config.get_text_config().vocab_size, args.seq_len, args.seed, image)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)  # kimi_hf's classes
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"--data stdlib needs a tokenizer in --model {args.model} ({e}); use --data random") from None
    return StdlibTokens(tokenizer, args.seq_len, args.steps, args.micro_batches * args.micro_batch)


def run(args, config, layout) -> list[float]:
    """Trains (and saves, exports) on this rank with the library's loop (kimi_hf.finetune.trainer: parallelize,
    train_step, MuonClip / AdamW, DCP checkpoints, the export): `config` and `layout` as checked."""
    from kimi_hf.finetune.trainer import Options, finetune

    options = Options(
        model=args.model,
        steps=args.steps,
        seed=args.seed,
        lora=args.lora,
        lora_rank=args.lora_rank,
        optimizer=args.optimizer,
        lr=args.lr,
        warmup=1,  # lr / 2 at step 0, then lr
        schedule="constant",
        max_grad_norm=0.0,  # no clipping
        qk_clip_tau=args.qk_clip_tau,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        micro_batches=args.micro_batches,
        pipeline_schedule=args.schedule,
        loss_chunk_size=None,  # the whole logits
        dtype=args.dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        resume=args.resume,
        export=args.export,
        overwrite=args.overwrite,
    )
    return finetune(options, config, layout, batches(args, config))


if __name__ == "__main__":
    main()
