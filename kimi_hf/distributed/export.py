"""Export a trained Kimi K3 from a sharded training checkpoint (kimi_hf.distributed.checkpoint) to the official K3
layout, streaming: no process ever holds the whole model.

- A LoRA run: the released folder it was trained from, shard by shard, with each adapted weight merged
  (W + alpha / r * B A, computed in fp32 when the weight is written, stored in the weight's own dtype); everything
  else (the MXFP4 experts' bytes, A_log's padding, the vision tower) is copied bit for bit, under the source's shard
  names and index. Peak: one source shard, its merged copy and the adapters' factors.
- A full fine-tuning run: the checkpoint's parameters, one decoder layer at a time (read from the DCP shards by
  name), turned into the release's names and shapes by `k3_state_dict` (the conversion `save_pretrained` uses;
  routed experts dense `.weight`, as trained weights are off the MXFP4 grid, and `quantization_config` dropped) and
  written by the converters' `ShardedWriter` in shards of at most `max_shard_size`. Peak: one layer plus one output
  shard.

OUT must not exist, or `overwrite=True` (the example's --overwrite) replaces it once the new folder is complete
(`check_export_dir`, checked before any tensor is read). The folder is built beside OUT and renamed into place at
the end (kimi_hf.conversion.output_dir): an error leaves no half-written OUT; files get open()'s modes (0644 under
umask 022). It loads with `from_pretrained` to the trained model's logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..atomic_io import set_normal_mode
from ..conversion.checkpoint import ShardedWriter
from ..conversion.output_dir import output_dir
from ..conversion.safetensors_stream import INDEX


PREFIX = "train.model."
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_export_dir(out_dir: str, model_dir: str, step_dir: str | None = None, overwrite: bool = False) -> None:
    """OUT must not exist; with overwrite it may, unless it is (or holds) the model folder or the checkpoint, which
    replacing it would delete. FileExistsError / ValueError naming the folder and the flag."""
    if not os.path.lexists(out_dir):
        return
    if not overwrite:
        raise FileExistsError(f"export folder {out_dir} exists: choose a new one, or pass --overwrite to replace it")
    inside = os.path.realpath(out_dir) + os.sep
    for what, path in (("the model folder", model_dir), ("the checkpoint", step_dir)):
        if path is not None and (os.path.realpath(path) + os.sep).startswith(inside):
            raise ValueError(f"--overwrite would delete export folder {out_dir}, which holds {what} {path}")


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


def _side_files(model_dir: str, skip: tuple[str, ...] = ()) -> list[str]:
    """config, tokenizer, processor, code: the paths of the source folder's files that are not weight shards (nor
    one of `skip`)."""
    return [
        os.path.join(model_dir, name)
        for name in sorted(os.listdir(model_dir))
        if os.path.isfile(os.path.join(model_dir, name)) and not name.endswith(".safetensors") and name not in skip
    ]


def _source_shards(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    if os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        return ["model.safetensors"]
    raise ValueError(f"{model_dir}: no model.safetensors or {INDEX}")


# ---- LoRA: the source folder with the adapters merged ----------------------------------------------------------
def lora_factors(step_dir: str, text_config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{released weight name: (B [out, r], A [r, in])} for every adapter in the checkpoint: the small factors only,
    each delta B A is formed when its weight is written (at K3's size the deltas of all adapted weights would be
    hundreds of GB)."""
    from ..models.kimi_k3.state_dict_kimi_k3 import released_name

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
        released, _ = released_name(module + ".weight", sparse)
        out[released] = (tensors[b_key], tensors[a_key])
    return out


def export_lora(step_dir: str, model_dir: str, out_dir: str, scaling: float, overwrite: bool = False) -> dict:
    """The released folder `model_dir` with the LoRA checkpoint's adapters merged, written to `out_dir` (which must
    not exist unless `overwrite`)."""
    from transformers import AutoConfig

    import kimi_hf  # noqa: F401

    check_export_dir(out_dir, model_dir, step_dir, overwrite)
    config = AutoConfig.from_pretrained(model_dir)
    factors = {name: (b, a, scaling) for name, (b, a) in lora_factors(step_dir, config.get_text_config()).items()}
    return merge_into_folder(model_dir, out_dir, factors, overwrite)


def merge_into_folder(
    model_dir: str, out_dir: str, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]], overwrite: bool = False
) -> dict:
    """The released folder `model_dir` with each weight named in `factors` ({released weight name: (B [out, r],
    A [r, in], scale)}) merged as W + scale B A (fp32, stored in W's dtype), shard by shard under the source's shard
    names and index, its other files copied; written to `out_dir` (checked by the caller: `check_export_dir`).
    Shared by export_lora and kimi_hf.adapters_released.merge_released_adapter."""
    factors = dict(factors)
    shards = _source_shards(model_dir)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    merged = 0
    with output_dir(out_dir, ".export-", overwrite) as tmp:
        for shard in shards:
            tensors = {}
            with safe_open(os.path.join(model_dir, shard), framework="pt") as f:
                metadata = f.metadata()
                for name in f.keys():
                    t = f.get_tensor(name)
                    if name in factors:
                        b, a, scale = factors.pop(name)
                        t = torch.addmm(t.float(), b.float(), a.float(), alpha=scale).to(t.dtype)
                        merged += 1
                    tensors[name] = t
            path = os.path.join(tmp, shard)
            save_file(tensors, path, metadata=metadata)
            set_normal_mode(path)  # safetensors writes 0o600 (through its own temporary file)
            del tensors
        if factors:
            raise ValueError(f"{model_dir}: no weight for the adapters of {sorted(factors)[:3]} ...")
        for path in _side_files(model_dir):  # the index too: the shards keep their names
            shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))  # contents only: normal modes
    return {"merged": merged}


# ---- full fine-tuning: the checkpoint's parameters in the release's layout --------------------------------------
def export_full(
    step_dir: str, model_dir: str, out_dir: str, max_shard_size: int | str = "5GB", overwrite: bool = False
) -> dict:
    """The full fine-tuning checkpoint's model as a released-layout folder (dense experts), one layer at a time,
    written to `out_dir` (which must not exist unless `overwrite`)."""
    from transformers import AutoConfig

    import kimi_hf  # noqa: F401
    from kimi_hf import KimiK3ForConditionalGeneration

    from ..models.kimi_k3.state_dict_kimi_k3 import k3_state_dict

    check_export_dir(out_dir, model_dir, step_dir, overwrite)
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
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    raw.get("text_config", {}).pop("quantization_config", None)  # the experts are dense now
    with ShardedWriter(out_dir, max_shard_size, overwrite=overwrite) as writer:
        for group in sorted(groups, key=lambda g: (g == "rest", g if g != "rest" else 0)):
            tensors = _load(step_dir, meta, groups[group])
            released = k3_state_dict(model, "dense", {k[len(PREFIX) :]: t for k, t in tensors.items()})
            del tensors
            for name, t in released.items():
                writer.add(name, t)
            del released
        for path in _side_files(model_dir, skip=(INDEX, "config.json")):
            writer.copy(path)
        writer.write_json("config.json", raw)
        names = writer.finish()
    return {"shards": len(names), "bytes": writer.total_bytes}


__all__ = ["check_export_dir", "export_full", "export_lora", "lora_factors", "merge_into_folder"]
