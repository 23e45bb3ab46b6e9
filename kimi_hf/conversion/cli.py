"""Command lines of the converters (`kimi-hf convert ...`, conversion/*.py)."""

from __future__ import annotations

import argparse

from ..cli import ArgumentParser
from .safetensors_stream import parse_size


KIMI_LINEAR_DOC = """Convert Kimi Linear checkpoints between Moonshot's / transformers' `kimi_linear` naming and kimi_hf's.

    kimi-hf convert kimi-linear SRC_DIR DST_DIR [--dtype bfloat16] [--max-shard-size 5GB] [--verify]
    (also: python conversion/convert_kimi_linear.py ... in a source checkout)

The direction follows SRC's config.json: model_type "kimi_linear" (Moonshot's original checkpoints,
and what transformers' own save_pretrained writes) converts to ours; "kimi_hybrid_text" converts back
to Moonshot's naming, which transformers' native KimiLinearForCausalLM loads. Streaming: one layer at
a time (its routed experts stacked), output in shards of at most --max-shard-size with
model.safetensors.index.json; the peak memory is printed. The output is written to a temporary
directory and renamed at the end: a failed or interrupted run leaves no output and never touches SRC.
--verify loads SRC and the result (the first --verify-layers layers; 0 = all) in a fresh process and
compares their logits.
"""
K25_VISION_DOC = """Assemble an early-fusion checkpoint: a hybrid KDA/MLA text checkpoint + Kimi K2.5's vision tower.

    kimi-hf convert k25-vision TEXT_DIR K25_DIR DST_DIR [--image-token-id N] [--dtype bfloat16]
    (also: python conversion/convert_kimi_k25_vision.py ... in a source checkout)

TEXT_DIR: kimi_hf's `kimi_hybrid_text` or a Kimi Linear checkpoint (Moonshot / transformers naming).
K25_DIR: a Kimi K2.5 checkpoint (Moonshot's naming, or what transformers' kimi_k25 saves); only its
vision tower and projector are read. Output: KimiHybridForConditionalGeneration (config + sharded
safetensors + the text checkpoint's tokenizer files), written atomically. Streaming, one tensor at a
time. K2.5's projector maps to 7168 (DeepSeek-V3's hidden): with another text hidden size its last
layer is left out and initialised at load time (a note says so).
"""


def shard_size(text: str) -> int:
    """argparse type of --max-shard-size (every converter's): '5GB', '500MB', '100KB' or a number of bytes, > 0."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(name):
    import torch

    return getattr(torch, name) if name else None


def kimi_linear_parser(prog: str | None = None) -> ArgumentParser:
    p = ArgumentParser(prog=prog, description=KIMI_LINEAR_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="checkpoint directory (config.json + safetensors, sharded or not)")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="cast floating tensors (A_log, dt_bias and the router bias stay as they are)",
    )
    p.add_argument("--max-shard-size", type=shard_size, default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--verify", action="store_true", help="compare the logits of SRC and the result")
    p.add_argument("--verify-layers", type=int, default=2, help="decoder layers to load for --verify (0: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def kimi_linear_main(argv=None, prog: str | None = None) -> dict:
    """`kimi-hf convert kimi-linear` (prog: the program named in the usage; default: the script's name)."""
    args = kimi_linear_parser(prog).parse_args(argv)
    from . import convert_kimi_linear, verify_kimi_linear

    summary = convert_kimi_linear(
        args.src, args.dst, _dtype(args.dtype), args.max_shard_size, show_progress=not args.no_progress
    )
    print(
        f"wrote a {summary['model_type']} checkpoint to {args.dst}: {summary['tensors']} tensors in {summary['shards']} "
        f"shard(s); peak memory {summary['peak_rss_mb']:.0f} MB (largest tensor {summary['largest_tensor_mb']:.1f} MB)"
    )
    if args.verify:
        summary["rel_max_diff"] = verify_kimi_linear(args.src, args.dst, args.verify_layers)
        print(f"verified: logits agree to {summary['rel_max_diff']:.1e} (relative max difference)")
    return summary


def k25_vision_parser(prog: str | None = None) -> ArgumentParser:
    p = ArgumentParser(prog=prog, description=K25_VISION_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", help="text checkpoint directory")
    p.add_argument("k25", help="Kimi K2.5 checkpoint directory")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument(
        "--image-token-id",
        type=int,
        default=None,
        help="the image placeholder id (default: the tokenizer's <|media_pad|>)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="cast floating tensors")
    p.add_argument("--max-shard-size", type=shard_size, default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def k25_vision_main(argv=None, prog: str | None = None) -> dict:
    """`kimi-hf convert k25-vision` (prog: the program named in the usage; default: the script's name)."""
    args = k25_vision_parser(prog).parse_args(argv)
    from .k25_vision import assemble

    summary = assemble(
        args.text,
        args.k25,
        args.dst,
        args.image_token_id,
        _dtype(args.dtype),
        args.max_shard_size,
        show_progress=not args.no_progress,
    )
    print(
        f"wrote {args.dst}: {summary['tensors']} tensors in {summary['shards']} shard(s), image token id "
        f"{summary['image_token_id']}; peak memory {summary['peak_rss_mb']:.0f} MB"
    )
    return summary
