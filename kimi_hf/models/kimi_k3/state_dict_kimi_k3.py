"""Kimi K3's released checkpoint layout (`moonshotai/Kimi-K3`) against kimi_hf's module names, both ways, outside
transformers' loader: the save side of the conversion mapping and the in-place load that Trainer's resume runs.

- `k3_state_dict`: the model's tensors under the release's names and shapes (`save_pretrained`, the streaming export
  of kimi_hf.distributed.export): prefixes, Attention Residual pairs ([1, d] queries), A_log padded to [head_dim],
  stacked routed experts split into per-expert `w1` / `w3` / `w2`, MXFP4-packed (`weight_packed` / `weight_scale`)
  or dense `.weight`.
- `released_name`: one of our tensor names -> its released name (and shape), the renames alone.
- `load_k3_state_dict`: a released-layout state dict (all of it or one shard) copied into a model in place.
- `check_mxfp4_headers`: a released folder's MXFP4 expert headers against the config, before any tensor is read.

The name tables are conversion_mapping_kimi_k3's (one declaration for both directions). Copied flat into saved
folders with modeling_kimi_k3 (which imports it): imports are torch, transformers, the stdlib and siblings only.
"""

import glob
import os
import re

import torch
from transformers.utils import logging

from ...mx_block import MX_BLOCK
from ...ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from ..kimi_hybrid.conversion_mapping_kimi_hybrid import EXPERT_WEIGHTS, MOE_BLOCK, MOONVIT_NAMES, rename_pairs
from ..kimi_hybrid.modeling_kimi_hybrid_multimodal import _is_dtensor
from .conversion_mapping_kimi_k3 import K3_PREFIXES, K3_RES_NAMES, K3_RES_PARAMS


logger = logging.get_logger(__name__)

# K3_PREFIXES turned around (ours -> released), the longest first; the tower's MoonViT names back to the release's
_OUR_PREFIXES = sorted(((ours, released) for released, ours in K3_PREFIXES), key=lambda p: -len(p[0]))
_MOONVIT_BACK = [(re.compile(src), tgt) for src, tgt in rename_pairs(MOONVIT_NAMES, reverse=True)]
_LANGUAGE_MODEL = K3_PREFIXES[0][0]  # "language_model.model."
# How `k3_state_dict` / `save_pretrained(saved_experts=)` can write the routed experts.
SAVED_EXPERTS = ("mxfp4", "dense", "lossless")


def released_name(name: str, sparse_layers: set[int]) -> tuple[str, tuple | None]:
    """Our state-dict name -> (K3's released name, the released shape if it differs: (1, -1) for the Attention
    Residual queries), from the name tables of conversion_mapping_kimi_k3. A stacked routed experts tensor keeps its
    stacked leaf (`...block_sparse_moe.experts.gate_up_proj`): `k3_state_dict` splits it into per-expert tensors."""
    for ours, released in _OUR_PREFIXES:
        if name.startswith(ours):
            rest = name[len(ours) :]
            break
    else:
        raise ValueError(f"k3_state_dict: unexpected tensor {name}")
    if released == "vision_tower.":
        for pattern, back in _MOONVIT_BACK:
            if pattern.match(rest):
                return released + pattern.sub(back, rest, count=1), None
    if released != _LANGUAGE_MODEL:
        return released + rest, None
    shape = None
    for res_released, res_ours in K3_RES_NAMES:
        for theirs, mine in K3_RES_PARAMS:
            if rest.endswith(res_ours + mine):
                rest = rest[: -len(res_ours + mine)] + res_released + theirs
                shape = (1, -1) if mine == ".query" else None
    m = re.match(r"layers\.(\d+)\.", rest)
    if m and int(m.group(1)) in sparse_layers:
        rest = rest.replace(f".{MOE_BLOCK[1]}.", f".{MOE_BLOCK[0]}.", 1)
    return released + rest, shape


def released_key_mapping(text_only: bool = False) -> dict[str, str]:
    """Kimi K3's released module names -> ours as PEFT's `key_mapping` (regex -> replacement, the first match
    applied once, on a key without `base_model.model.`): what `PeftModel.from_pretrained` reads off a model's
    `_checkpoint_conversion_mapping` to load an adapter saved in the release's names (kimi_hf.adapters_released).
    Every pattern is anchored at a released top-level name, which none of ours starts with, so an adapter in our own
    names loads unchanged. text_only: for KimiK3ForCausalLM (`model.*`, `lm_head.*`), which has no vision tower."""
    prefixes = dict(K3_PREFIXES)
    if text_only:
        prefixes = {_LANGUAGE_MODEL: "model.", K3_PREFIXES[1][0]: "lm_head."}
    mapping = {}
    if "vision_tower." in prefixes:  # the tower's MoonViT renames, whole (the first match is the only one)
        for src, tgt in rename_pairs(MOONVIT_NAMES):
            mapping["^" + re.escape("vision_tower.") + src.removeprefix("^")] = prefixes["vision_tower."] + tgt
    # a MoE layer's block: renamed with its prefix
    moe = "^" + re.escape(_LANGUAGE_MODEL) + r"layers\.(\d+)\." + re.escape(MOE_BLOCK[0] + ".")
    mapping[moe] = prefixes[_LANGUAGE_MODEL] + rf"layers.\1.{MOE_BLOCK[1]}."
    mapping.update({"^" + re.escape(released): ours for released, ours in prefixes.items()})
    return mapping


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor- / expert-parallel parameter (DTensor) gathered whole (a collective: every rank calls it, in the
    state dict's order); a plain tensor as it is."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def k3_state_dict(
    model: torch.nn.Module,
    saved_experts: str = "mxfp4",
    state_dict: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The model's tensors under Kimi K3's released names and shapes (the inverse of the load-time conversion):
    `language_model.model.*` / `language_model.lm_head.weight` / `vision_tower.*` / `mm_projector.*`, MoE blocks as
    `block_sparse_moe` with per-expert `w1` (gate), `w3` (up), `w2` (down), Attention Residual pairs as
    `*_res_norm.weight` [d] and `*_res_proj.weight` [1, d], `A_log` zero-padded to [head_dim].
    saved_experts (how the routed experts are written; `experts_format` is how a model holds them in memory) "mxfp4":
    `weight_packed` / `weight_scale` (round to nearest E2M1 where a weight is not on the
    grid; lossless for weights loaded from MXFP4), "dense": `.weight` in the model's dtype (bf16 for a bf16 model),
    "lossless": MXFP4 if every expert is on the MXFP4 grid (exact), else dense (what `save_pretrained` does by default
    for a model loaded from MXFP4, so that a save never rounds a fine-tuned weight silently).
    state_dict: the model's tensors under its own names (default `model.state_dict()`; Trainer passes its own, e.g.
    accelerate's gathered FSDP state dict)."""
    if saved_experts not in SAVED_EXPERTS:
        raise ValueError(f"saved_experts must be one of {SAVED_EXPERTS}, got {saved_experts!r}")
    if saved_experts == "lossless":
        try:
            return _k3_state_dict(model, "exact", state_dict)
        except _OffGrid as e:
            logger.warning(
                f"{e}: the routed experts are no longer on the MXFP4 grid (trained?), so they are saved as dense "
                "`.weight` tensors, losslessly; pass saved_experts='mxfp4' to round them to MXFP4 instead"
            )
            return _k3_state_dict(model, "dense", state_dict)
    return _k3_state_dict(model, saved_experts, state_dict)


class _OffGrid(ValueError):
    """An expert weight that MXFP4 cannot hold exactly (k3_state_dict's "lossless" format falls back to dense)."""


def _k3_state_dict(model, saved_experts: str, state_dict) -> dict[str, torch.Tensor]:
    """k3_state_dict's conversion; saved_experts "mxfp4", "exact" (MXFP4, raising _OffGrid) or "dense"."""
    text = model.config.text_config
    sparse = {i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"}
    out = {}
    state = model.state_dict() if state_dict is None else state_dict
    for name, tensor in state.items():
        if name.endswith(_SCALE) and name[: -len(_SCALE)].rpartition(".")[2] in EXPERT_WEIGHTS:
            continue  # a resident expert's E8M0 scales: written with its packed bytes
        tensor = _full(tensor.detach())
        key, shape = released_name(name, sparse)
        if shape is not None:
            tensor = tensor.reshape(shape)
        if not key.startswith(_LANGUAGE_MODEL):
            out[key] = tensor
            continue
        if key.endswith("self_attn.A_log"):
            padded = tensor.new_zeros(max(text.linear_head_dim, tensor.numel()))
            padded[: tensor.numel()] = tensor  # the release stores [head_dim], heads first, zeros after
            tensor = padded
        if key.endswith(f"{MOE_BLOCK[0]}.gate.weight") and torch.equal(
            tensor.to(model.dtype).to(tensor.dtype), tensor
        ):
            # kept fp32 in memory, stored in the model's dtype as released, unless that would round it (trained)
            tensor = tensor.to(model.dtype)
        base, _, leaf = key.rpartition(".")
        if base.endswith(".experts") and leaf in EXPERT_WEIGHTS and tensor.dtype == torch.uint8:
            _released_mxfp4_experts(
                out, base, leaf, tensor, _full(state[name + _SCALE].detach()), saved_experts, model
            )
            continue
        if base.endswith(".experts") and leaf in EXPERT_WEIGHTS:
            names = EXPERT_WEIGHTS[leaf]  # the stacked rows are the experts' weights in this order
            parts = dict(zip(names, tensor.chunk(len(names), dim=1)))
            for w, stacked in parts.items():
                for e in range(stacked.shape[0]):
                    expert = f"{base}.{e}.{w}"
                    if saved_experts in ("mxfp4", "exact"):
                        try:
                            packed, scale = quantize_mxfp4(stacked[e], name=expert, exact=saved_experts == "exact")
                        except ValueError as err:
                            if saved_experts == "exact" and "not MXFP4-representable" in str(err):
                                raise _OffGrid(expert) from None
                            raise
                        out[expert + ".weight_packed"], out[expert + ".weight_scale"] = packed, scale
                    else:
                        out[expert + ".weight"] = stacked[e].contiguous()
            continue
        out[key] = tensor
    return out


_SCALE = "_scale"  # KimiHybridMxfp4Experts: `gate_up_proj` holds the packed bytes, `gate_up_proj_scale` the scales


def _released_mxfp4_experts(out, base, leaf, packed, scale, saved_experts, model) -> None:
    """A resident layer's stacked MXFP4 bytes (packed [E, rows, in / 2], scale [E, rows, in / 32]) as the release's
    per-expert tensors: the bytes themselves for "mxfp4" / "exact" (bit for bit: they are what was loaded), decoded
    into the model's dtype for "dense"."""
    names = EXPERT_WEIGHTS[leaf]
    for w, p, s in zip(names, packed.chunk(len(names), dim=1), scale.chunk(len(names), dim=1)):
        for e in range(p.shape[0]):
            expert = f"{base}.{e}.{w}"
            if saved_experts == "dense":
                out[expert + ".weight"] = dequantize_mxfp4(p[e], s[e], dtype=model.dtype, name=expert)
            else:
                out[expert + ".weight_packed"], out[expert + ".weight_scale"] = p[e].contiguous(), s[e].contiguous()


RELEASED_PREFIXES = tuple(dict.fromkeys(released.split(".")[0] + "." for released, _ in K3_PREFIXES))
# a routed expert's tensor in the release: (layer, expert, w1 / w3 / w2, weight_packed | weight_scale | weight)
_RELEASED_EXPERT = re.compile(
    rf"^{re.escape(_LANGUAGE_MODEL)}layers\.(\d+)\.{MOE_BLOCK[0]}\.experts\.(\d+)\."
    rf"({'|'.join(w for parts in EXPERT_WEIGHTS.values() for w in parts)})\.(weight_packed|weight_scale|weight)$"
)
# released expert weight -> (our stacked parameter, its part, the number of parts): w3 -> ("gate_up_proj", 1, 2)
_EXPERT_PART = {w: (stacked, i, len(parts)) for stacked, parts in EXPERT_WEIGHTS.items() for i, w in enumerate(parts)}


@torch.no_grad()
def load_k3_state_dict(model: torch.nn.Module, state_dict: dict) -> tuple[set, set]:
    """Copies a state dict in Kimi K3's released layout (all of it or one shard) into the model's parameters in
    place; returns (missing, unexpected) under the model's names. Routed experts (`w1` / `w3` / `w2`, MXFP4 or
    `.weight`) are decoded one by one into their slice of `gate_up_proj` (w1 rows, then w3 rows) and `down_proj`;
    everything else goes through transformers' loader with K3's conversion mapping (one source for the renames,
    A_log's padding and the Attention Residual shapes), whose new tensors are then copied into the old ones."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    from .conversion_mapping_kimi_k3 import k3_mapping, mxfp4_bytes

    experts, rest = {}, {}
    for key, tensor in state_dict.items():
        m = _RELEASED_EXPERT.match(key)
        if m:
            experts.setdefault(m.groups()[:3], {})[m.group(4)] = (key, tensor)
        else:
            rest[key] = tensor
    unexpected = set()
    # a packed expert whose weight_packed and weight_scale came in different calls (shards): the first half waits
    # on the model for the other
    pending = model.__dict__.setdefault("_k3_pending_expert_halves", {})
    for group in list(experts):
        if group in pending:
            experts[group] = {**pending.pop(group), **experts[group]}
    for group, parts in list(experts.items()):
        if "weight" not in parts and len(parts) == 1:
            pending[group] = experts.pop(group)
    filled = {}  # stacked parameter -> the (expert, w) parts this call wrote
    for (layer, e, w), parts in experts.items():
        name = _stacked_experts_name(layer, w)
        first = next(iter(parts.values()))[0]
        try:
            param = model.get_parameter(name)
        except AttributeError:
            unexpected.update(key for key, _ in parts.values())
            continue
        if _is_dtensor(param):
            raise NotImplementedError(
                f"{first}: load_state_dict of Kimi K3's released layout into tensor / expert-parallel experts; load "
                "the folder with from_pretrained(..., tp_plan=... / distributed_config=...) instead"
            )
        if int(e) >= param.shape[0]:
            unexpected.update(key for key, _ in parts.values())
            continue
        _, part, n_parts = _EXPERT_PART[w]
        target = param[int(e)].chunk(n_parts, dim=0)[part]
        if "weight" in parts and len(parts) > 1:
            raise ValueError(f"{first}: an expert stored both as .weight and as MXFP4 bytes")
        resident = param.dtype == torch.uint8  # MXFP4 experts kept as bytes: target [rows, in / 2]
        if resident and "weight" in parts:
            raise ValueError(
                f"{first}: a dense expert weight cannot go into experts kept in MXFP4 (experts_format='mxfp4'); "
                "load the model with experts_format='dense'"
            )
        if "weight" in parts:
            value = parts["weight"][1]
        else:
            key = parts["weight_packed"][0]
            logical = (target.shape[0], 2 * target.shape[1]) if resident else tuple(target.shape)
            value, scale = mxfp4_bytes(parts["weight_packed"][1], parts["weight_scale"][1], key, logical)
            if resident:  # the bytes go in as they are, the scales beside them
                model.get_parameter(name + _SCALE)[int(e)].chunk(n_parts, dim=0)[part].copy_(scale)
            else:
                value = dequantize_mxfp4(value, scale, dtype=param.dtype, name=key)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{first}: shape {tuple(value.shape)}, the model's {tuple(target.shape)}")
        target.copy_(value)
        filled.setdefault(name, set()).add((int(e), w))
    # a stacked parameter counts as loaded when this call wrote every expert's parts (a shard writes some)
    covered = {
        name
        for name, parts in filled.items()
        if parts
        >= {(e, w) for e in range(model.get_parameter(name).shape[0]) for w in EXPERT_WEIGHTS[name.rsplit(".", 1)[1]]}
    }
    partly = set(filled) - covered
    # a resident layer's scales come with its packed bytes
    covered |= {n + _SCALE for n in covered if model.get_parameter(n).dtype == torch.uint8}
    partly |= {n + _SCALE for n in partly if model.get_parameter(n).dtype == torch.uint8}
    waiting = {_stacked_experts_name(layer, w) for layer, _, w in pending}
    if not rest:
        return waiting | partly, unexpected  # only experts: a shard (the caller knows what the checkpoint holds)
    before = dict(model.named_parameters(remove_duplicate=False))
    before.update(model.named_buffers(remove_duplicate=False))
    # converted on the CPU: each new tensor then goes into its old one (on the model's device) one at a time, so the
    # accelerator never holds two copies of the shard
    config = LoadStateDictConfig(weight_mapping=k3_mapping(), device_map={"": "cpu"})
    conversions = getattr(model, "_weight_conversions", None)
    info, _ = convert_and_load_state_dict_in_model(model, rest, config, None)
    if conversions is None:
        model.__dict__.pop("_weight_conversions", None)
    else:
        model._weight_conversions = conversions  # what from_pretrained recorded stays
    for name, old in before.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        new = getattr(module, attr)
        if new is not old:  # the loader set a new tensor: its values go into the old one, which stays
            old.copy_(new.detach())
            if attr in module._parameters:
                module._parameters[attr] = old
            else:
                module._buffers[attr] = old
    if info.conversion_errors:
        from ..hub_kimi import conversion_error_messages

        raise ValueError("; ".join(conversion_error_messages(info.conversion_errors)))
    if info.mismatched_keys:
        raise ValueError(
            "size mismatch: "
            + "; ".join(f"{k}: {tuple(a)} vs the model's {tuple(b)}" for k, a, b in info.mismatched_keys)
        )
    missing = (set(info.missing_keys) - covered) | waiting | partly
    return missing, unexpected | set(info.unexpected_keys)


def _stacked_experts_name(layer: str, w: str) -> str:
    """The model's stacked experts parameter that released expert tensor w (w1 / w3 / w2) of a layer goes into."""
    return f"{K3_PREFIXES[0][1]}layers.{layer}.{MOE_BLOCK[1]}.experts.{_EXPERT_PART[w][0]}"


def check_mxfp4_headers(folder: str, text_config) -> None:
    """Every routed expert's `weight_packed` / `weight_scale` in a released folder's safetensors headers (shapes and
    dtypes only: no tensor is read) against the config: uint8, [out, in / 2] / [out, in / 32] of w1 / w3 [I, latent]
    and w2 [latent, I], experts below num_experts. A ValueError names the first bad tensor and its file."""
    from safetensors import safe_open

    latent = text_config.routed_expert_hidden_size or text_config.hidden_size
    inter = text_config.moe_intermediate_size
    logical = {"w1": (inter, latent), "w3": (inter, latent), "w2": (latent, inter)}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                m = _RELEASED_EXPERT.match(key)
                if m is None or m.group(4) == "weight":
                    continue
                layer, e, w, part = m.groups()
                out, n_in = logical[w]
                want = (out, n_in // 2) if part == "weight_packed" else (out, n_in // MX_BLOCK)
                view = f.get_slice(key)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
                where = f"{key} ({os.path.basename(path)})"
                if dtype != "U8":
                    raise ValueError(f"{where}: MXFP4 {part} must be uint8 (U8), got {dtype}")
                if shape != want:
                    raise ValueError(
                        f"{where}: shape {list(shape)}, expected {list(want)} for the [{out}, {n_in}] {w} weight of "
                        f"moe_intermediate_size {inter} / routed_expert_hidden_size {latent} (two E2M1 codes a byte, "
                        "one scale byte per 32)"
                    )
                if int(e) >= text_config.num_experts:
                    raise ValueError(f"{where}: expert {e}, but the config has num_experts {text_config.num_experts}")


__all__ = [
    "RELEASED_PREFIXES",
    "SAVED_EXPERTS",
    "check_mxfp4_headers",
    "k3_state_dict",
    "load_k3_state_dict",
    "released_key_mapping",
    "released_name",
]
