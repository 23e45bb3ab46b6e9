"""`kimi-hf finetune`: fine-tune Kimi K3 (or Kimi Linear) on your data, on any layout, one command a node.

    kimi-hf finetune --model DIR --data PATH|stdlib|random [--eval-data PATH] [--eval-every N] [--lora | --full]
        [--lora-rank R] [--optimizer muonclip|adamw] [--lr X] [--warmup N] [--schedule constant|cosine|wsd]
        [--steps N] [--seed S] [--seq-len T] [--micro-batch B] [--micro-batches M] [--tp N] [--ep N] [--pp N]
        [--fsdp N] [--cp N] [--gradient-checkpointing] [--checkpoint-dir D] [--save-every N] [--resume]
        [--save-adapter DIR] [--export DIR] [--config FILE]
    torchrun --nnodes N --nproc-per-node 8 ... $(which kimi-hf) finetune ...          (or accelerate launch)

--data PATH: a .jsonl / .json / .parquet file or a `datasets` save_to_disk folder in TRL's formats (`messages`
with optional `tools` and `images`; `prompt` / `completion`; `text`), rendered by the model's chat template, the loss
on the assistant's tokens (or the completion), packed into --seq-len rows with document boundaries
(kimi_hf.finetune.data / packing). --data stdlib / random: the standard library's sources / random token ids.
--fsdp left out is the data ranks the other sizes leave. Rank 0 prints one JSON line per step {"step": i, "loss": x}
and per evaluation {"step": i, "eval_loss": x}, nothing else on stdout (a progress bar on stderr). A bad flag, file
or row is one line on stderr naming it, exit status 2, before any model is built (printed once). --config FILE (YAML
or JSON) holds the same keys (dashes or underscores); flags given on the command line override it.
"""

from __future__ import annotations

import json
import os
import sys

from ..cli_args import ArgumentParser, refuse


PROG = "kimi-hf finetune"
SIZES = ("tp", "ep", "pp", "cp", "fsdp")


def parser(prog: str = PROG) -> ArgumentParser:
    p = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file of these options (flags override it)")
    p.add_argument("--model", metavar="DIR", help="the model folder (Kimi K3 in its released layout, or Kimi Linear)")
    p.add_argument("--data", metavar="PATH|stdlib|random", help="the training data (see above)")
    p.add_argument("--eval-data", metavar="PATH", help="held-out data in the same formats: its loss is logged")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--lora", action="store_true", default=None, help="LoRA adapters, the base frozen (default)")
    mode.add_argument("--full", action="store_true", default=None, help="full fine-tuning (K3's experts loaded dense)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--optimizer", choices=("muonclip", "adamw"), default="muonclip")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    p.add_argument("--schedule", choices=("constant", "cosine", "wsd"), default="cosine", help="after the warm-up")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the whole model's gradient norm (0: off)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens a packed row")
    p.add_argument("--micro-batch", type=int, default=1, help="rows a micro-batch")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches a step over all data ranks (default: one a rank)",
    )
    p.add_argument("--packing", choices=("bfd", "wrapped"), default="bfd", help="whole documents, or cut at row ends")
    p.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        help="keywords of the chat template for every row, a JSON object (a row's own chat_template_kwargs win): "
        'K3 renders a "max" thinking-effort preamble by default, \'{"thinking_effort": null}\' leaves it out',
    )
    for name in ("tp", "ep", "pp", "cp"):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{name} size")
    p.add_argument("--fsdp", type=int, default=None, help="FSDP2 shards (default: the data ranks the others leave)")
    p.add_argument("--pipeline-schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=1024,
        help="the head and the loss computed this many tokens at a time, the logits never whole (0: whole logits)",
    )
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="auto: bf16 on CUDA")
    p.add_argument("--gradient-checkpointing", action="store_true", default=None)
    p.add_argument("--qk-clip-tau", type=float, default=100.0)
    p.add_argument("--checkpoint-dir", metavar="D", help="sharded checkpoints (step-N) to resume from")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from --checkpoint-dir's latest step")
    p.add_argument("--save-adapter", metavar="DIR", help="the LoRA adapter, as a PEFT folder in K3's released names")
    p.add_argument("--export", metavar="DIR", help="the trained model in K3's released layout (LoRA: merged)")
    p.add_argument("--overwrite", action="store_true", default=None, help="replace an existing output folder")
    p.add_argument("--log-dir", metavar="DIR", help="TensorBoard event files (needs the tensorboard package)")
    return p


def _read_config_file(path: str) -> dict:
    """The options of a YAML / JSON file: {name: value}, names with dashes or underscores."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    try:
        if path.endswith(".json"):
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception as e:  # a parse error of either format, said in one line
        raise ValueError(f"--config {path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def parse_args(argv=None, prog: str = PROG):
    """The options: the --config file's, then the command line's over them. ValueError for a bad one."""
    p = parser(prog)
    args = p.parse_args(argv)
    if args.config:
        values = _read_config_file(args.config)
        known = {a.dest for a in p._actions} - {"help", "config"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--config {args.config}: unknown option {unknown[0]!r}")
        p.set_defaults(**values)
        args = p.parse_args(argv)  # the command line over the file
    if args.model is None or args.data is None:
        raise ValueError(f"{'--model' if args.model is None else '--data'} is required")
    if args.lora and args.full:
        raise ValueError("--lora and --full: choose one")
    args.lora = not args.full
    for name in ("steps", "seq_len", "micro_batch", "lora_rank"):
        if not isinstance(getattr(args, name), int) or getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)!r}")
    for name in ("warmup", "eval_every", "save_every", "loss_chunk_size"):
        if not isinstance(getattr(args, name), int) or getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 0, got {getattr(args, name)!r}")
    args.loss_chunk_size = args.loss_chunk_size or None
    if not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if args.export and not args.checkpoint_dir:
        raise ValueError("--export needs --checkpoint-dir: the export streams the trained weights from the checkpoint")
    if args.save_adapter and not args.lora:
        raise ValueError("--save-adapter saves LoRA adapters: drop --full")
    if args.eval_data and args.data in ("stdlib", "random"):
        raise ValueError(f"--eval-data goes with --data PATH (--data {args.data} has no held-out split)")
    args.chat_template_kwargs = _template_kwargs(args.chat_template_kwargs)
    return args


def _template_kwargs(value) -> dict | None:
    """--chat-template-kwargs: a JSON object on the command line, or a mapping in a --config file."""
    if value is None or isinstance(value, dict):
        return value
    try:
        value = json.loads(value)
    except ValueError as e:
        raise ValueError(f"--chat-template-kwargs: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs: expected a JSON object of keywords, got {value!r}")
    return value


def check_folders(args):
    """The folders, before any expensive work: --model (`check_model_folder`: its config.json and every safetensors
    header against its file's size), --checkpoint-dir's steps for --resume, and on rank 0 the folders it will write
    (--export, --save-adapter: new, or --overwrite) and --log-dir's TensorBoard. Returns the model's config (read
    with kimi_hf's classes, never the folder's code). `examples/k3_finetune.py` checks its flags with it too."""
    from ..distributed.parallelize import MODEL_TYPES, read_config
    from ..model_folder import check_model_folder

    check_model_folder(args.model, what="--model", model_types=MODEL_TYPES)
    config = read_config(args.model)
    if args.resume:
        from ..distributed.checkpoint import checkpoint_steps

        if not checkpoint_steps(args.checkpoint_dir):
            raise ValueError(f"--checkpoint-dir {args.checkpoint_dir}: no checkpoint (step-N folder) to resume from")
    if os.environ.get("RANK", "0") == "0":
        from ..distributed.export import check_export_dir

        for out in (args.export, getattr(args, "save_adapter", None)):
            if out:
                check_export_dir(out, args.model, args.checkpoint_dir, overwrite=bool(args.overwrite))
        if getattr(args, "log_dir", None):
            from .metrics import check_tensorboard

            check_tensorboard(args.log_dir)
    return config


def check_layout(args, config, world: int, pipeline_schedule: str):
    """The layout of the flags on `world` ranks (`ParallelDims.for_model`: every size and rule, the sequence over
    --cp; --fsdp left out is what the others leave), refused with the flag that makes it run; --micro-batches left
    out is one a rank that sees its own batch (1F1B: pp of them); the batch over the data ranks. Returns the dims."""
    from ..distributed import ParallelDims

    sizes = {n: getattr(args, n) for n in SIZES}
    dims = ParallelDims.for_model(world, config.get_text_config(), seq_len=args.seq_len, **sizes)
    if args.micro_batches is None:
        args.micro_batches = dims.batch_ranks * (dims.pp if dims.pp > 1 and pipeline_schedule == "1f1b" else 1)
    dims.check_batch(args.micro_batches, pipeline_schedule)
    return dims


def check(args, world: int):
    """Everything before the model: the folders, the layout, the batch, the data (read, checked and tokenized).
    Returns (config, ParallelDims, train source, eval source or None)."""
    import torch

    config = check_folders(args)
    dims = check_layout(args, config, world, args.pipeline_schedule)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    train, held_out = sources(args, config)
    return config, dims, train, held_out


def sources(args, config):
    """(train source, eval source or None): objects with global_batch(step, rows) (and epoch_batches(rows))."""
    from .batches import RandomTokens, StdlibTokens

    rows = args.micro_batches * args.micro_batch
    if args.data == "random":
        image = getattr(config, "image_token_id", None)
        return RandomTokens(config.get_text_config().vocab_size, args.seq_len, args.seed, image), None
    tokenizer = _tokenizer(args)
    if args.data == "stdlib":
        return StdlibTokens(tokenizer, args.seq_len, args.steps, rows), None
    from .data import load_sft_rows, tokenize_sft_rows
    from .packing import PackedDataset

    def packed(path: str, flag: str, shuffle: bool):
        data = load_sft_rows(path, name=f"{flag} {path}")
        docs = tokenize_sft_rows(data, tokenizer, chat_template_kwargs=args.chat_template_kwargs)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        packed = PackedDataset(docs, args.seq_len, strategy=args.packing, seed=args.seed, pad_id=pad, shuffle=shuffle)
        lost = [
            f"{n} {what}"
            for n, what in (
                (packed.truncated, f"cut to --seq-len {args.seq_len}"),
                (packed.dropped, "left out (no token to train on within --seq-len)"),
                (docs.skipped, "rows with nothing to train on, skipped"),
            )
            if n
        ]
        if lost and os.environ.get("RANK", "0") == "0":  # said, not silent (stderr: stdout is the JSON lines)
            print(f"{PROG}: {flag} {path}: {len(docs)} documents; {', '.join(lost)}", file=sys.stderr)
        return packed

    train = packed(args.data, "--data", shuffle=True)
    held_out = packed(args.eval_data, "--eval-data", shuffle=False) if args.eval_data else None
    return train, held_out


def _tokenizer(args):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(args.model, trust_remote_code=False)  # kimi_hf's own classes: no prompt
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"--data {args.data} needs a tokenizer in --model {args.model} ({e}); use --data random"
        ) from None


def options_of(args):
    from .trainer import Options

    fields = Options.__dataclass_fields__
    values = {name: getattr(args, name) for name in fields if hasattr(args, name) and getattr(args, name) is not None}
    return Options(**values)


def main(argv=None, prog: str = PROG) -> list[float]:
    """Parses, checks (refusals: one line, exit 2, printed once), trains. Returns the steps' losses."""
    try:
        args = parse_args(argv, prog)
    except (ValueError, TypeError, OSError) as e:
        refuse(e, prog, printer="RANK")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config, dims, train, held_out = check(args, world)
    except (ValueError, TypeError, OSError) as e:
        refuse(e, prog, printer="RANK")
    from .trainer import finetune

    try:
        return finetune(options_of(args), config, dims, train, held_out)
    except (ValueError, TypeError, OSError) as e:
        refuse(e, prog)


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
