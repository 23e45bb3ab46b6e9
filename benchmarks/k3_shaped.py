"""The K3-shaped model of the memory benchmarks (k3_lora_memory.py, k3_rank_load.py): Kimi K3's structure at a smaller
width, the routed experts >= 90% of the parameters (K3: 97%), written in the released layout (MXFP4 experts) by
the tests' independent writer (tests/models/kimi_k3/release_format.py)."""

from __future__ import annotations

import argparse
import os
import time


def k3_shaped_config(
    experts: int, layers: int, hidden: int, latent: int, inter: int, vocab: int, heads: int | None = None
) -> dict:
    """K3's structure at a smaller width: the tests' tiny release config with K3-like proportions (experts top-16
    of many, latent = hidden / 2, 2 shared experts, AttnRes blocks of 2 layers)."""
    from tests.models.kimi_k3.release_format import tiny_k3_config

    heads = heads or hidden // 128
    return tiny_k3_config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 4,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        linear_attn_config={"num_heads": heads, "head_dim": 64},
        num_experts=experts,
        num_experts_per_token=16,
        num_shared_experts=2,
        moe_intermediate_size=inter,
        routed_expert_hidden_size=latent,
        attn_res_block_size=2,
    )


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])


def write_k3_shaped(folder: str, args, shards: int = 4, heads: int | None = None, quiet: bool = False) -> int:
    """Writes the folder (seed 0); prints (unless quiet) and returns its size on disk in bytes."""
    from tests.models.kimi_k3.release_format import write_k3_checkpoint

    config = k3_shaped_config(args.experts, args.layers, args.hidden, args.latent, args.inter, args.vocab, heads)
    t0 = time.perf_counter()
    write_k3_checkpoint(folder, config, seed=0, mxfp4=True, shards=shards, dtype=args.dtype)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not quiet:
        print(f"# folder: {size / 2**30:.2f} GiB on disk, written in {time.perf_counter() - t0:.0f} s", flush=True)
    return size
