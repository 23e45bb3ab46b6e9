"""Command lines of the converters (`kimi-hf convert kimi-linear | k25-vision | k3`, conversion/*.py).

Torch-free until a command converts: the parsers import only argparse helpers (kimi_hf.cli_args) and the
fp32 list (for the help texts); each `*_main` imports its converter when it runs.
"""

from __future__ import annotations

import argparse
from string import Template

from ..cli_args import ArgumentParser, layer_count, size
from .fp32 import describe, k3_fp32, kimi_linear_fp32


KIMI_LINEAR_DOC = Template("""Convert Kimi Linear checkpoints between Moonshot's / transformers' `kimi_linear` naming and kimi_hf's.

    kimi-hf convert kimi-linear SRC_DIR DST_DIR [--dtype bfloat16] [--max-shard-size 5GB] [--verify]
    (also: python conversion/convert_kimi_linear.py ... in a source checkout)

The direction follows SRC's config.json: model_type "kimi_linear" (Moonshot's original checkpoints,
and what transformers' own save_pretrained writes) converts to ours; "kimi_hybrid_text" converts back
to Moonshot's naming, which transformers' native KimiLinearForCausalLM loads. Streaming: one layer at
a time (its routed experts stacked), output in shards of at most --max-shard-size with
model.safetensors.index.json; the peak memory is printed. --dtype casts the floating tensors but those the
model keeps in float32 ($fp32), which stay as SRC stores them. The output is written to a temporary
directory and renamed at the end: a failed or interrupted run leaves no output and never touches SRC.
--verify loads SRC and the result (the first --verify-layers layers, extended to the first MLA layer; 0 = all)
in a fresh process and compares their logits.
""")
K25_VISION_DOC = Template("""Assemble an early-fusion checkpoint: a hybrid KDA/MLA text checkpoint + Kimi K2.5's vision tower.

    kimi-hf convert k25-vision TEXT_DIR K25_DIR DST_DIR [--image-token-id N] [--dtype bfloat16]
    (also: python conversion/convert_kimi_k25_vision.py ... in a source checkout)

TEXT_DIR: kimi_hf's `kimi_hybrid_text` or a Kimi Linear checkpoint (Moonshot / transformers naming).
K25_DIR: a Kimi K2.5 checkpoint (Moonshot's naming, or what transformers' kimi_k25 saves); only its
vision tower and projector are read. Output: KimiHybridForConditionalGeneration (config + sharded
safetensors + the text checkpoint's tokenizer files), written atomically. Streaming, one tensor at a
time; the peak memory is printed. --dtype casts the floating tensors but those the model keeps in float32
($fp32). K2.5's projector maps to 7168 (DeepSeek-V3's hidden): with another text hidden size its last
layer is left out and initialised at load time (a note says so).
""")
K3_DOC = Template("""Dequantise a Kimi K3 folder: MXFP4 routed experts -> plain tensors, in the official K3 names.

    kimi-hf convert k3 SRC DST [--dtype bfloat16|float16|float32] [--max-shard-size 5GB] [--verify]
                       [--verify-layers N] [--overwrite] [--no-progress]
    (also: python conversion/convert_k3.py ... in a source checkout)

SRC: a Kimi K3 folder as released (config.json with model_type "kimi_k3", sharded safetensors with
model.safetensors.index.json), its routed experts in compressed-tensors' mxfp4-pack-quantized format. Every
experts.{E}.w{1,2,3}.weight_packed + .weight_scale pair becomes experts.{E}.w{1,2,3}.weight in --dtype
(lossless in bfloat16 and float32); every other tensor keeps its name and is cast to --dtype, except those the
release stores in float32 ($fp32), which stay float32. config.json loses its quantization_config (and says
--dtype); every other file of SRC is copied unchanged (its remote code too, never run: the converter reads the
tokenizer itself and never asks to trust remote code). A folder whose experts are already plain tensors is
copied and cast.

Everything is checked before any tensor is read. Streaming: one tensor at a time; output shards of at most
--max-shard-size with a new model.safetensors.index.json; the peak memory is printed. The output is written to
a temporary directory next to DST and renamed at the end: a failed or interrupted run leaves nothing at DST.
--verify loads SRC and the result with KimiK3ForConditionalGeneration in float32 in a fresh process (the whole
model, or its first --verify-layers layers, extended to the first MLA layer) and compares their logits before
the result is moved to DST: they must agree to 1e-6 (where --dtype rounded SRC's float32 tensors, SRC's loaded
copy is rounded the same way first). DST must be new or an empty directory; --overwrite replaces an existing
one once the new folder is complete.
""")
# kimi-linear's and k25-vision's --dtype (none: as SRC stores them); k3 has its own default and order
HYBRID_DTYPES = ["float32", "bfloat16", "float16"]
K3_DTYPES = ["bfloat16", "float16", "float32"]


def _parser(prog: str | None, doc: Template, fp32: tuple[str, ...]) -> ArgumentParser:
    """A converter's parser, its description `doc` naming the tensors kept in float32."""
    return ArgumentParser(
        prog=prog,
        description=doc.substitute(fp32=describe(fp32)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _output_options(p: ArgumentParser, verify_layers: int | None = None) -> None:
    """The options every converter shares: --max-shard-size, --no-progress and (verify_layers: the default of
    --verify-layers) --verify."""
    p.add_argument(
        "--max-shard-size",
        type=size,
        default="5GB",
        help="largest output shard: 5GB = 5 x 10^9 bytes, 5GiB = 5 x 2^30, or bytes (default 5GB)",
    )
    if verify_layers is not None:
        p.add_argument(
            "--verify", action="store_true", help="compare the logits of SRC and the result (fresh process)"
        )
        p.add_argument(
            "--verify-layers",
            type=layer_count,
            default=verify_layers,
            help=f"decoder layers --verify loads (0: all; default {verify_layers})",
        )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _dtype(name):
    import torch

    return getattr(torch, name) if name else None


def kimi_linear_parser(prog: str | None = None) -> ArgumentParser:
    p = _parser(prog, KIMI_LINEAR_DOC, kimi_linear_fp32())
    p.add_argument("src", help="checkpoint directory (config.json + safetensors, sharded or not)")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument(
        "--dtype",
        choices=HYBRID_DTYPES,
        default=None,
        help="cast floating tensors (those the model keeps in float32 stay as they are)",
    )
    _output_options(p, verify_layers=2)
    return p


def kimi_linear_main(argv=None, prog: str | None = None) -> dict:
    """`kimi-hf convert kimi-linear` (prog: the program named in the usage; default: the script's name)."""
    args = kimi_linear_parser(prog).parse_args(argv)
    from .kimi_linear import convert, verify

    summary = convert(args.src, args.dst, _dtype(args.dtype), args.max_shard_size, show_progress=not args.no_progress)
    print(
        f"wrote a {summary['model_type']} checkpoint to {args.dst}: {summary['tensors']} tensors in {summary['shards']} "
        f"shard(s); peak memory {summary['peak_rss_mb']:.0f} MB (largest tensor {summary['largest_tensor_mb']:.1f} MB)"
    )
    if args.verify:
        summary["rel_max_diff"] = verify(args.src, args.dst, args.verify_layers)
        print(f"verified: logits agree to {summary['rel_max_diff']:.1e} (relative max difference)")
    return summary


def k25_vision_parser(prog: str | None = None) -> ArgumentParser:
    p = _parser(prog, K25_VISION_DOC, kimi_linear_fp32())
    p.add_argument("text", help="text checkpoint directory")
    p.add_argument("k25", help="Kimi K2.5 checkpoint directory")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument(
        "--image-token-id",
        type=int,
        default=None,
        help="the image placeholder id (default: the tokenizer's <|media_pad|>)",
    )
    p.add_argument(
        "--dtype",
        choices=HYBRID_DTYPES,
        default=None,
        help="cast floating tensors (those the model keeps in float32 stay as they are)",
    )
    _output_options(p)
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


def k3_parser(prog: str | None = None) -> ArgumentParser:
    p = _parser(prog, K3_DOC, k3_fp32())
    p.add_argument("src", metavar="SRC", help="a Kimi K3 folder (config.json + safetensors shards + index)")
    p.add_argument("dst", metavar="DST", help="output directory (new or empty; see --overwrite)")
    p.add_argument(
        "--dtype",
        choices=K3_DTYPES,
        default="bfloat16",
        help="dtype of the experts and the other floating tensors (those the release stores in float32 stay "
        "float32); default bfloat16",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace DST if it exists (once the new folder is complete)"
    )
    _output_options(p, verify_layers=0)
    return p


def k3_main(argv=None, prog: str | None = None) -> dict:
    """`kimi-hf convert k3` (prog: the program named in the usage; default: the script's name)."""
    args = k3_parser(prog).parse_args(argv)
    from .k3 import convert_k3

    report = convert_k3(
        args.src,
        args.dst,
        args.dtype,
        args.max_shard_size,
        verify=args.verify,
        overwrite=args.overwrite,
        verify_layers=args.verify_layers,
        show_progress=False if args.no_progress else None,
    )
    rounded = "" if report["lossless"] else f" ({len(report['rounded_tensors'])} tensors rounded to it)"
    print(
        f"wrote {args.dst}: {report['tensors']} tensors ({report['experts_dequantised']} MXFP4 expert weights "
        f"dequantised) in {report['shards']} shard(s), {report['bytes'] / 1e9:.3f} GB of {report['dtype']}{rounded}, "
        f"{len(report['copied_files'])} other files copied; {report['seconds']:.1f} s, peak memory "
        f"{report['peak_rss_mb']:.0f} MB (+{report['peak_rss_growth_mb']:.0f} MB while converting)"
    )
    if report["skipped_files"]:
        print(
            f"note: not copied (safetensors files that SRC's index does not name): {', '.join(report['skipped_files'])}"
        )
    if "verify" in report:
        v = report["verify"]
        how = f" (SRC's wider tensors rounded to {v['round_to']}, as converted)" if v["round_to"] else ""
        print(
            f"verified: SRC{how} and DST give the same logits (max |diff| {v['max_abs_diff']:.2g}, largest logit "
            f"{v['max_abs_logit']:.3g}; {v['layers']} layers, {v['tokens']} tokens, float32)"
        )
    return report


__all__ = [
    "k25_vision_main",
    "k25_vision_parser",
    "k3_main",
    "k3_parser",
    "kimi_linear_main",
    "kimi_linear_parser",
]
