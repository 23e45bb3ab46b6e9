"""Convert Kimi Linear checkpoints between transformers' `kimi_linear` and kimi_hf's `kimi_hybrid_text`.

    python conversion/convert_kimi_linear.py SRC_DIR DST_DIR [--dtype bfloat16]

The direction follows SRC's config.json: model_type "kimi_linear" (Moonshot's original checkpoints,
and what transformers' own save_pretrained writes) converts to ours; "kimi_hybrid_text" converts back
to Moonshot's naming, which transformers' native KimiLinearForCausalLM loads. Tensors are read one
by one with safetensors (a layer's routed experts are gathered together); the output is written to
a temporary directory and renamed at the end, so a failed run leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

OURS, NATIVE = "kimi_hybrid_text", "kimi_linear"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def _shard_files(src: str) -> list[str]:
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {src}")
    missing = [n for n in files if not os.path.exists(os.path.join(src, n))]
    if missing:
        raise FileNotFoundError(f"missing shards in {src}: {missing}")
    return [os.path.join(src, n) for n in files]


def iter_tensors(src: str):
    """Yields (name, tensor) over all shards of a checkpoint directory, one tensor at a time."""
    for path in _shard_files(src):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def native_to_ours(tensors, num_heads: int):
    """Moonshot / native names -> ours. Yields (name, tensor)."""
    experts = defaultdict(dict)  # prefix -> {(e, w): tensor}
    for name, t in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
        if (m := _EXPERT.match(name)) is not None:
            experts[m.group(1)][(int(m.group(2)), m.group(3))] = t
            continue
        if name.endswith(".self_attn.A_log"):
            yield name, t.reshape(num_heads)
        elif name.endswith(".self_attn.conv1d.weight"):  # native runtime layout: q, k, v stacked
            for part, w in zip("qkv", t.chunk(3, dim=0)):
                yield name.replace("conv1d", f"{part}_conv1d"), w.contiguous()
        else:
            yield name, t
    for prefix, parts in experts.items():
        E = 1 + max(e for e, _ in parts)
        try:
            yield f"{prefix}.gate_up_proj", torch.stack([torch.cat([parts[(e, "w1")], parts[(e, "w3")]]) for e in range(E)])
            yield f"{prefix}.down_proj", torch.stack([parts[(e, "w2")] for e in range(E)])
        except KeyError as err:
            raise ValueError(f"{prefix}: expert tensor {err.args[0]} is missing") from None


def ours_to_native(tensors):
    """Ours -> Moonshot's names (what transformers' kimi_linear loads). Yields (name, tensor)."""
    for name, t in tensors:
        if name.endswith(".self_attn.A_log"):
            yield name, t.reshape(1, 1, -1, 1)
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")].replace(".mlp.", ".block_sparse_moe.")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                yield f"{prefix}.{e}.w1.weight", gate.contiguous()
                yield f"{prefix}.{e}.w3.weight", up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")].replace(".mlp.", ".block_sparse_moe.")
            for e, w in enumerate(t):
                yield f"{prefix}.{e}.w2.weight", w.contiguous()
        else:
            yield name, t


_NATIVE_RENAMES = {"num_local_experts": "num_experts"}


def convert_config(cfg: dict) -> dict:
    """config.json of one side -> the other's."""
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "transformers_version")}
    if cfg.get("model_type") == NATIVE:
        from kimi_hf import KimiHybridTextConfig

        cfg.pop("model_type")
        for a, b in _NATIVE_RENAMES.items():
            if a in cfg:
                cfg[b] = cfg.pop(a)
        ours = KimiHybridTextConfig(**cfg)
        out = ours.to_dict()
        out["architectures"] = ["KimiHybridForCausalLM"]
        return out
    if cfg.get("model_type") == OURS:
        out = {k: v for k, v in cfg.items() if k not in ("router_aux_loss_coef", "mla_use_nope")}
        out["model_type"] = NATIVE
        for a, b in _NATIVE_RENAMES.items():
            if b in out:
                out[a] = out.pop(b)
        out["architectures"] = ["KimiLinearForCausalLM"]
        return out
    raise ValueError(f"config.json has model_type {cfg.get('model_type')!r}; expected {NATIVE!r} or {OURS!r}")


def convert(src: str, dst: str, dtype: torch.dtype | None = None) -> str:
    """Converts checkpoint directory src into dst (which must not exist). Returns dst's model_type."""
    if os.path.exists(dst):
        raise FileExistsError(f"{dst} exists; choose a new output directory")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    new_cfg = convert_config(cfg)
    if cfg["model_type"] == NATIVE:
        heads = cfg.get("linear_num_heads") or cfg.get("linear_attn_config", {}).get("num_heads") or new_cfg["linear_num_heads"]
        tensors = native_to_ours(iter_tensors(src), heads)
    else:
        tensors = ours_to_native(iter_tensors(src))
    parent = os.path.dirname(os.path.abspath(dst))
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
    try:
        state = {}
        for name, t in tensors:
            if name in state:
                raise ValueError(f"tensor {name} produced twice: mixed checkpoint namings?")
            keep_fp32 = name.endswith((".A_log", ".dt_bias", "e_score_correction_bias"))
            state[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() and not keep_fp32 else t).contiguous()
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if dtype is not None:
            new_cfg["dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(new_cfg, f, indent=2)
        for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(os.path.join(src, extra)):
                shutil.copy(os.path.join(src, extra), tmp)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return new_cfg["model_type"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("dst", help="output directory (must not exist)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast floating tensors (gates A_log, dt_bias and the router bias stay as they are)")
    args = p.parse_args(argv)
    kind = convert(args.src, args.dst, getattr(torch, args.dtype) if args.dtype else None)
    print(f"wrote {kind} checkpoint to {args.dst}")


if __name__ == "__main__":
    sys.exit(main())
