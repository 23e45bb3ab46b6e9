"""Kimi Linear checkpoints: Moonshot's original / transformers' `kimi_linear` naming <-> ours.

Moonshot's original checkpoints and transformers' own `save_pretrained` of KimiLinearForCausalLM use
one naming ("native" below): `block_sparse_moe.experts.{e}.w1/w2/w3`, `A_log` as [1, 1, H, 1],
separate `q/k/v_conv1d` (transformers' in-memory layout stacks them into one `conv1d`, accepted too),
and the dense layer 0 as `block_sparse_moe.{gate,up,down}_proj` or `mlp.{gate,up,down}_proj`.
Ours stacks the routed experts ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) and keeps A_log [H].

Conversion streams layer by layer: only one layer's tensors (a layer's experts are stacked into the
largest tensor) and the output shard being filled are in memory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import torch

from .checkpoint import CheckpointReader, ShardedWriter, peak_rss_mb, progress, read_config
from .tokenizer import convert_tokenizer_dir

OURS, NATIVE = "kimi_hybrid_text", "kimi_linear"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_KEEP_FP32 = (".A_log", ".dt_bias", "e_score_correction_bias")  # gates and the router bias keep their precision
_NATIVE_RENAMES = {"num_local_experts": "num_experts"}
EXTRA_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "chat_template.jinja", "tiktoken.model", "tokenization_kimi.py")


def native_to_ours(tensors, num_heads: int):
    """(name, tensor) in the native naming -> ours, for the tensors of one layer (or the non-layer ones)."""
    experts = defaultdict(dict)  # prefix -> {(e, w): tensor}
    for name, t in tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")
        if (m := _EXPERT.match(name)) is not None:
            experts[m.group(1)][(int(m.group(2)), m.group(3))] = t
            continue
        if name.endswith(".self_attn.A_log"):
            yield name, t.reshape(num_heads)
        elif name.endswith(".self_attn.conv1d.weight"):  # transformers' in-memory layout: q, k, v stacked
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
            e, w = err.args[0]
            raise ValueError(f"{prefix}.{e}.{w}.weight is missing (experts must come complete)") from None


def ours_to_native(tensors):
    """(name, tensor) in our naming -> Moonshot's (what transformers' kimi_linear loads)."""
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


def cast(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """--dtype for one tensor: floating tensors are cast, except the gates and the router bias."""
    if dtype is None or not t.is_floating_point() or name.endswith(_KEEP_FP32):
        return t
    return t.to(dtype)


def copy_side_files(src: str, writer: ShardedWriter) -> bool:
    """Copies generation config and tokenizer files next to the weights; Kimi's tiktoken files also
    become a fast tokenizer.json. Returns whether that conversion happened."""
    for extra in EXTRA_FILES:
        if os.path.exists(os.path.join(src, extra)):
            writer.copy(os.path.join(src, extra))
    return convert_tokenizer_dir(src, writer.tmp)


def convert_config(cfg: dict) -> dict:
    """config.json of one side -> the other's."""
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "transformers_version")}
    if cfg.get("model_type") == NATIVE:
        from kimi_hf import KimiHybridTextConfig

        cfg.pop("model_type")
        for a, b in _NATIVE_RENAMES.items():
            if a in cfg:
                cfg[b] = cfg.pop(a)
        out = KimiHybridTextConfig(**cfg).to_dict()
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
    raise ValueError(f"config.json has model_type {cfg.get('model_type')!r}: not a Kimi Linear checkpoint "
                     f"(expected {NATIVE!r} or {OURS!r})")


def expected_shapes(our_config: dict) -> dict[str, tuple[int, ...]]:
    """Our tensor names and shapes for a config (a model built on the meta device: no memory)."""
    from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig

    cfg = KimiHybridTextConfig(**{k: v for k, v in our_config.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = KimiHybridForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _groups(names: list[str]) -> list[list[str]]:
    """Tensor names grouped by decoder layer (non-layer tensors first), layers in order."""
    by_layer = defaultdict(list)
    for n in names:
        m = _LAYER.match(n)
        by_layer[int(m.group(1)) if m else -1].append(n)
    return [by_layer[k] for k in sorted(by_layer)]


def convert(src: str, dst: str, dtype: torch.dtype | None = None, max_shard_size: int = 5 << 30,
            show_progress: bool = True) -> dict:
    """Converts checkpoint directory src into dst (must not exist), streaming. Returns a summary
    {"model_type", "shards", "tensors", "peak_rss_mb", "largest_tensor_mb"}."""
    cfg = read_config(src)
    new_cfg = convert_config(cfg)  # refuses another architecture before any tensor is read
    reader = CheckpointReader(src)
    to_ours = cfg["model_type"] == NATIVE
    expected = expected_shapes(new_cfg if to_ours else cfg)
    heads = new_cfg["linear_num_heads"] if to_ours else cfg["linear_num_heads"]
    largest = 0
    with ShardedWriter(dst, max_shard_size) as writer:
        groups = _groups(reader.names())
        for names in progress(groups, len(groups), "converting", show_progress):
            source = ((n, reader.get(n)) for n in names)
            ours = native_to_ours(source, heads) if to_ours else source
            checked = _check(ours, expected, reader, names)
            for name, t in (checked if to_ours else ours_to_native(checked)):
                t = cast(name, t, dtype)
                largest = max(largest, t.numel() * t.element_size())
                writer.add(name, t)
        missing = sorted(set(expected) - _seen_ours(writer.seen, to_ours))
        if missing:
            raise ValueError(f"{len(missing)} tensors are missing from {src}, e.g. {missing[:5]}")
        if dtype is not None:
            new_cfg["dtype"] = str(dtype).removeprefix("torch.")
        writer.write_json("config.json", new_cfg)
        fast_tokenizer = copy_side_files(src, writer)
        shards = writer.finish()
    return {"model_type": new_cfg["model_type"], "shards": len(shards), "tensors": len(writer.seen),
            "peak_rss_mb": peak_rss_mb(), "largest_tensor_mb": largest / 2**20, "fast_tokenizer": fast_tokenizer}


def _check(tensors, expected: dict, reader: CheckpointReader, source_names: list[str]):
    """Passes (name, tensor) in our naming through, refusing unknown names and wrong shapes (the
    error names the tensor and the file it came from)."""
    files = sorted({reader.file_of(n) for n in source_names})
    for name, t in tensors:
        if name not in expected:
            raise ValueError(f"unknown tensor {name} (from {', '.join(files)}): not part of this Kimi Linear "
                             "config; a checkpoint of another architecture or a mismatched config.json?")
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"tensor {name} (from {', '.join(files)}) has shape {tuple(t.shape)}, the config "
                             f"implies {expected[name]}")
        yield name, t


def _seen_ours(written: set[str], to_ours: bool) -> set[str]:
    """Our names of what was written (the native names of stacked experts and A_log map back)."""
    if to_ours:
        return written
    out = set()
    for n in written:
        if (m := re.match(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.\d+\.(w1|w3|w2)\.weight$", n)):
            out.add(f"{m.group(1)}.mlp.experts.{'down_proj' if m.group(2) == 'w2' else 'gate_up_proj'}")
        else:
            out.add(n)
    return out


def verify(src: str, dst: str, layers: int = 2, atol: float = 1e-3) -> float:
    """Loads src and dst (their first `layers` decoder layers; 0 = all) in a fresh process, with their
    own classes, and compares the logits of random tokens. Returns the max abs difference relative to
    the largest logit; raises if it exceeds atol."""
    cmd = [sys.executable, "-m", "kimi_hf.conversion.verify_worker", src, dst, str(layers)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"verification could not run:\n{out.stderr[-3000:]}")
    diff = json.loads(out.stdout.strip().splitlines()[-1])["rel_max_diff"]
    if not diff <= atol:
        raise ValueError(f"logits of {src} and {dst} differ by {diff:.2e} (relative), more than {atol}")
    return diff


__all__ = ["convert", "verify", "convert_config", "native_to_ours", "ours_to_native", "expected_shapes"]
