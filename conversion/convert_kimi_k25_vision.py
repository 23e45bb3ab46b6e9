"""Assemble an early-fusion checkpoint: a hybrid KDA/MLA text checkpoint + Kimi K2.5's vision tower.

    python conversion/convert_kimi_k25_vision.py TEXT_DIR K25_DIR DST_DIR [--image-token-id N] [--dtype bfloat16]

TEXT_DIR: kimi_hf's `kimi_hybrid_text` or a Kimi Linear checkpoint (Moonshot / transformers naming).
K25_DIR: a Kimi K2.5 checkpoint (Moonshot's naming, or what transformers' kimi_k25 saves); only its
vision tower and projector are read. Output: KimiHybridForConditionalGeneration (config + sharded
safetensors + the text checkpoint's tokenizer files), written atomically. Streaming, one tensor at a
time. K2.5's projector maps to 7168 (DeepSeek-V3's hidden): with another text hidden size its last
layer is left out and initialised at load time (a note says so).
"""

from __future__ import annotations

import argparse

import torch

from kimi_hf.conversion import parse_size
from kimi_hf.conversion.k25_vision import assemble


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("text", help="text checkpoint directory")
    p.add_argument("k25", help="Kimi K2.5 checkpoint directory")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument("--image-token-id", type=int, default=None,
                   help="the image placeholder id (default: the tokenizer's <|media_pad|>)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    summary = assemble(args.text, args.k25, args.dst, args.image_token_id, getattr(torch, args.dtype) if args.dtype else None,
                       parse_size(args.max_shard_size), show_progress=not args.no_progress)
    print(f"wrote {args.dst}: {summary['tensors']} tensors in {summary['shards']} shard(s), image token id "
          f"{summary['image_token_id']}; peak memory {summary['peak_rss_mb']:.0f} MB")
    return summary


if __name__ == "__main__":
    main()
