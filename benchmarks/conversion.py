"""Conversion memory: the streaming Kimi Linear converter's peak memory against the checkpoint size.

    python benchmarks/conversion.py                  # ~0.6 GB synthetic checkpoint (fp32), 200 MB shards
    python benchmarks/conversion.py --hidden 2048 --experts 32 --layers 8

Writes a synthetic Kimi Linear checkpoint in Moonshot's naming (random tensors, sharded, written
layer by layer), then runs `conversion/convert_kimi_linear.py` on it in a fresh process and prints its
peak resident memory next to the checkpoint size, the largest tensor, the shard size and the memory
of a process that only imports kimi_hf (the floor).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import argument_parser  # noqa: E402

from kimi_hf.conversion.checkpoint import ShardedWriter, parse_size  # noqa: E402
from kimi_hf.conversion.kimi_linear import _groups, expected_shapes, ours_to_native  # noqa: E402


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def synthetic(path: str, args) -> dict:
    cfg = dict(
        model_type="kimi_hybrid_text",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_num_heads=8,
        linear_head_dim=args.hidden // 8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    shapes = expected_shapes(cfg)
    with ShardedWriter(path, parse_size(args.shard)) as w:
        for names in _groups(list(shapes)):
            for name, t in ours_to_native((n, torch.randn(shapes[n]) * 0.02) for n in names):
                w.add(name, t)
        from kimi_hf.conversion.kimi_linear import convert_config

        w.write_json("config.json", convert_config(cfg))
        w.finish()
    largest = max(torch.Size(s).numel() for s in shapes.values()) * 4
    return {"bytes": sum(torch.Size(s).numel() for s in shapes.values()) * 4, "largest": largest}


def peak_of(cmd: list[str]) -> float:
    """Peak resident memory (MB) of a child process, from wait4's rusage."""
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(proc.stderr.read().decode()[-2000:])
    return usage.ru_maxrss / 1024


def main(argv=None):
    p = argument_parser(__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--shard", default="200MB", help="shard size of the input and of the output")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "native"), os.path.join(tmp, "ours")
        info = synthetic(src, args)
        floor = peak_of(["-c", "import kimi_hf, kimi_hf.conversion"])
        peak = peak_of(
            [
                os.path.join(ROOT, "conversion", "convert_kimi_linear.py"),
                src,
                dst,
                "--max-shard-size",
                args.shard,
                "--no-progress",
            ]
        )
        shards = len([f for f in os.listdir(dst) if f.endswith(".safetensors")])
    mb = lambda b: b / 2**20  # noqa: E731
    print(
        f"# streaming conversion, fp32 synthetic Kimi Linear ({args.layers} layers, hidden {args.hidden}, {args.experts} experts)"
    )
    print(
        "| checkpoint MB | largest tensor MB | shard MB | output shards | import-only MB | converter peak MB | peak - import-only MB |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {mb(info['bytes']):.0f} | {mb(info['largest']):.0f} | {mb(parse_size(args.shard)):.0f} | {shards} | {floor:.0f} | "
        f"{peak:.0f} | {peak - floor:.0f} |"
    )


if __name__ == "__main__":
    main()
