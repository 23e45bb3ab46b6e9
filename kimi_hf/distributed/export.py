"""Export a trained Kimi K3 from a sharded training checkpoint (kimi_hf.distributed.checkpoint) to the official K3
layout, streaming: no process ever holds the whole model.

- A LoRA run: the released folder it was trained from, shard by shard, with each adapted weight merged
  (W + alpha / r * B A, computed in fp32 when the weight is written, stored in the weight's own dtype); everything
  else (the MXFP4 experts' bytes, A_log's padding, the vision tower) is copied bit for bit. Peak: one source shard,
  its merged copy and the adapters' factors.
- A full fine-tuning run: the checkpoint's parameters, one decoder layer at a time (read from the DCP shards by
  name), turned into the release's names and shapes by `k3_state_dict` (the same conversion `save_pretrained`
  uses; routed experts dense `.weight`, as trained weights are off the MXFP4 grid, and `quantization_config`
  dropped) and written in shards of at most `max_shard_size` bytes. Peak: one layer plus one output shard.

The output is written under OUT.tmp and renamed at the end (files 0644); it loads with `from_pretrained` to the
trained model's logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file


PREFIX = "train.model."
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _reader(step_dir: str):  # -> the checkpoint's metadata
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(step_dir, ".metadata")):
        raise ValueError(f"{step_dir}: not a torch.distributed.checkpoint folder (no .metadata)")
    return FileSystemReader(step_dir).read_metadata()


def _load(step_dir: str, meta, keys: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors `keys` (full names), read from its shards in this process alone."""
    import torch.distributed.checkpoint as dcp

    out = {}
    for key in keys:
        m = meta.state_dict_metadata[key]
        out[key] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    dcp.load(out, checkpoint_id=step_dir, no_dist=True)
    return out


def _finish(tmp: str, out_dir: str) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(tmp):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)
    os.chmod(tmp, 0o777 & ~umask)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _start(out_dir: str) -> str:
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _copy_side_files(model_dir: str, tmp: str) -> None:
    """config, tokenizer, processor, code: every file of the source folder that is not a weight shard or index."""
    for name in os.listdir(model_dir):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copyfile(path, os.path.join(tmp, name))


def _source_shards(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise ValueError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


# ---- LoRA: the source folder with the adapters merged ----------------------------------------------------------
def lora_factors(step_dir: str, text_config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{released weight name: (B [out, r], A [r, in])} for every adapter in the checkpoint: the small factors only,
    each delta B A is formed when its weight is written (at K3's size the deltas of all adapted weights would be
    hundreds of GB)."""
    from ..models.kimi_k3.modeling_kimi_k3 import _released_name

    meta = _reader(step_dir)
    keys = [k for k in meta.state_dict_metadata if k.startswith(PREFIX) and ".lora_A." in k]
    if not keys:
        raise ValueError(f"{step_dir}: no LoRA adapters in this checkpoint (a full fine-tuning run? use export_full)")
    pairs = {k: k.replace(".lora_A.", ".lora_B.") for k in keys}
    tensors = _load(step_dir, meta, [*pairs, *pairs.values()])
    sparse = {i for i, t in enumerate(text_config.mlp_layer_types) if t == "sparse"}
    out = {}
    for a_key, b_key in pairs.items():
        module = a_key[len(PREFIX) :].removeprefix("base_model.model.").split(".lora_A.")[0]
        released, _ = _released_name(module + ".weight", sparse)
        out[released] = (tensors[b_key], tensors[a_key])
    return out


def export_lora(step_dir: str, model_dir: str, out_dir: str, scaling: float) -> dict:
    """The released folder `model_dir` with the LoRA checkpoint's adapters merged, written to `out_dir`."""
    from transformers import AutoConfig

    import kimi_hf  # noqa: F401

    config = AutoConfig.from_pretrained(model_dir)
    factors = lora_factors(step_dir, config.get_text_config())
    tmp = _start(out_dir)
    merged = 0
    for shard in _source_shards(model_dir):
        tensors = {}
        with safe_open(os.path.join(model_dir, shard), framework="pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                t = f.get_tensor(name)
                if name in factors:
                    b, a = factors.pop(name)
                    t = torch.addmm(t.float(), b.float(), a.float(), alpha=scaling).to(t.dtype)
                    merged += 1
                tensors[name] = t
        save_file(tensors, os.path.join(tmp, shard), metadata=metadata)
        del tensors
    if factors:
        shutil.rmtree(tmp)
        raise ValueError(f"{model_dir}: no weight for the adapters of {sorted(factors)[:3]} ...")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        shutil.copyfile(index, os.path.join(tmp, "model.safetensors.index.json"))
    _copy_side_files(model_dir, tmp)
    _finish(tmp, out_dir)
    return {"merged": merged}


# ---- full fine-tuning: the checkpoint's parameters in the release's layout --------------------------------------
def export_full(step_dir: str, model_dir: str, out_dir: str, max_shard_size: int = 5 * 10**9) -> dict:
    """The full fine-tuning checkpoint's model as a released-layout folder (dense experts), one layer at a time."""
    from transformers import AutoConfig

    import kimi_hf  # noqa: F401
    from kimi_hf import KimiK3ForConditionalGeneration

    from ..models.kimi_k3.modeling_kimi_k3 import _k3_state_dict

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type != "kimi_k3":
        raise ValueError(f"{model_dir}: the export writes Kimi K3's released layout, not {config.model_type!r}")
    meta = _reader(step_dir)
    keys = [k for k in meta.state_dict_metadata if k.startswith(PREFIX)]
    if any(".lora_A." in k for k in keys):
        raise ValueError(f"{step_dir}: a LoRA checkpoint (export it with lora=True)")
    stored = config.get_text_config().dtype or "bfloat16"
    dtype = stored if isinstance(stored, torch.dtype) else getattr(torch, str(stored).replace("torch.", ""))
    with torch.device("meta"):  # for the config and the dtype only: no tensor of it is ever filled
        model = KimiK3ForConditionalGeneration._from_config(config, dtype=dtype, experts_format="dense")
    groups: dict[object, list[str]] = {}
    for k in keys:
        m = _LAYER.search(k[len(PREFIX) :]) if "language_model." in k else None
        groups.setdefault(int(m.group(1)) if m else "rest", []).append(k)
    tmp = _start(out_dir)
    weight_map, shard, size, total, files = {}, {}, 0, 0, []

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for group in sorted(groups, key=lambda g: (g == "rest", g if g != "rest" else 0)):
        tensors = _load(step_dir, meta, groups[group])
        ours = {k[len(PREFIX) :]: t for k, t in tensors.items()}
        released = _k3_state_dict(model, "dense", ours)
        del tensors, ours
        for name, t in released.items():
            nbytes = t.numel() * t.element_size()
            if size and size + nbytes > max_shard_size:
                flush()
            shard[name] = t.contiguous()
            size += nbytes
            total += nbytes
        del released
    flush()
    # the shard names need the final count: model-0000i-of-0000N
    count, renamed = len(files), {}
    for i, name in enumerate(files, 1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        os.replace(os.path.join(tmp, name), os.path.join(tmp, final))
        renamed[name] = final
    index = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in sorted(weight_map.items())}}
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    _copy_side_files(model_dir, tmp)
    with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    raw.get("text_config", {}).pop("quantization_config", None)  # the experts are dense now
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    _finish(tmp, out_dir)
    return {"shards": count, "bytes": total}


__all__ = ["export_full", "export_lora", "lora_factors"]
