"""Kimi K3 (`moonshotai/Kimi-K3`) as transformers classes: the hybrid model's layers with K3's options
(configuration_kimi_k3.py), loading Moonshot's released folders directly.

`KimiK3ForConditionalGeneration.from_pretrained(k3_dir)` reads the released layout through transformers'
checkpoint conversion mapping (conversion_mapping_kimi_hybrid.k3_mapping): the `language_model.` /
`vision_tower.` / `mm_projector.` prefixes, K3's Attention Residual names, per-expert MXFP4 `w1/w2/w3`
dequantised (losslessly) and stacked while each shard loads, `A_log` [head_dim] narrowed to its heads.
`save_pretrained` writes that layout back (`k3_state_dict`): official names and shapes, the release's dtypes for
the router weight, experts re-packed as MXFP4 or written as plain `.weight` tensors (the config then says so).
"""

import contextlib
import glob
import os
import re

import torch
from transformers.utils import logging

from ...ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from ..kimi_hybrid.conversion_mapping_kimi_hybrid import EXPERT_WEIGHTS, MOE_BLOCK, MOONVIT_NAMES, rename_pairs
from ..kimi_hybrid.modeling_kimi_hybrid import KimiHybridForCausalLM, KimiHybridTextModel
from ..kimi_hybrid.modeling_kimi_hybrid_multimodal import (
    KimiHybridForConditionalGeneration,
    KimiHybridModel,
    _is_dtensor,
)
from .configuration_kimi_k3 import (
    EXPERTS_FORMATS,
    K3_MXFP4_QUANTIZATION_CONFIG,
    KimiK3Config,
    KimiK3TextConfig,
    experts_are_mxfp4,
)
from .conversion_mapping_kimi_k3 import K3_PREFIXES, K3_RES_NAMES, K3_RES_PARAMS
from .conversion_mapping_kimi_k3 import register_k3 as _register_k3_conversion_mapping


_register_k3_conversion_mapping()
logger = logging.get_logger(__name__)

# PEFT LoRA targets recommended for Kimi K3's text backbone: KDA's q/k/v/o projections, MLA's q LoRA chain, latent
# and kv expansion and output projection, the dense / shared-expert SiTU-GLU FFNs and the Stable LatentMoE bridges
# (the routed experts are stacked [E, out, in] parameters, not nn.Linear: the bridges are their trainable way in).
# Left out: the gates (KDA's f_a / f_b decay and b beta projections, the KDA / MLA output gates g_proj, the router),
# the vision tower and the projector (target_modules="all-linear" adapts those too).
K3_LORA_TARGET_MODULES = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "routed_expert_down_proj",
    "routed_expert_up_proj",
]


class KimiK3TextModel(KimiHybridTextModel):
    """K3's text backbone (`language_model.model` in the release): KimiHybridTextModel with K3's options."""

    config: KimiK3TextConfig
    config_class = KimiK3TextConfig


class KimiK3ForCausalLM(KimiHybridForCausalLM):
    """K3's text backbone with a head, for text-only use (AutoModelForCausalLM of a `kimi_k3_text` config): the
    hybrid causal LM's layout (`model.*`, `lm_head.*`; from_pretrained of a released multimodal folder gives
    KimiK3ForConditionalGeneration instead). It holds its routed experts dense, so it saves them dense: the
    config it writes has no quantization_config (KimiK3TextConfig.to_json_string)."""

    config: KimiK3TextConfig
    config_class = KimiK3TextConfig
    text_model_class = KimiK3TextModel


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
                want = (out, n_in // 2) if part == "weight_packed" else (out, n_in // 32)
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


class KimiK3ExpertsFormatMixin:
    """`from_pretrained(k3_dir, experts_format=...)` of the K3 models that read the released folder: "mxfp4" keeps the
    routed experts as their MXFP4 bytes in memory (frozen, dequantised on the fly: 4.25 bits a weight instead of 16),
    "dense" dequantises them at load into the model's dtype (to train them), "auto" (the default) is "mxfp4" for a
    folder that stores them in MXFP4, else "dense". Constructing a model from a config holds them dense unless
    `experts_format=` is passed (or config.text_config.experts_format was set)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, experts_format: str = "auto", **kwargs):
        if experts_format not in EXPERTS_FORMATS:
            raise ValueError(f"experts_format must be one of {EXPERTS_FORMATS}, got {experts_format!r}")
        path = pretrained_model_name_or_path  # None with state_dict= (transformers' common tests)
        folder = os.path.join(os.fspath(path), kwargs.get("subfolder") or "") if path is not None else None
        # a local folder: its MXFP4 headers are checked before any weight is read
        if folder is not None and os.path.isfile(os.path.join(folder, "config.json")):
            config = kwargs.get("config")
            if not isinstance(config, KimiK3Config):
                config = KimiK3Config.from_pretrained(folder)
            check_mxfp4_headers(folder, config.get_text_config())
        return super().from_pretrained(pretrained_model_name_or_path, *args, experts_format=experts_format, **kwargs)

    def __init__(self, config, experts_format: str | None = None):
        if experts_format is not None:
            config.get_text_config().experts_format = experts_format
        super().__init__(config)

    def requires_grad_(self, requires_grad: bool = True):
        """nn.Module.requires_grad_, leaving integer tensors alone (the MXFP4 bytes of resident routed experts take
        no gradient; training their MoE layers in full is refused in the forward, with an explanation)."""
        for param in self.parameters():
            if param.is_floating_point() or param.is_complex() or not requires_grad:
                param.requires_grad_(requires_grad)
        return self

    @property
    def experts_format(self) -> str:
        """ "mxfp4" (routed experts resident as MXFP4 bytes) or "dense"."""
        return self.config.get_text_config().experts_format


class KimiK3Model(KimiK3ExpertsFormatMixin, KimiHybridModel):
    """Vision tower (MoonViT3d), patchmergerv2 projector and the K3 text backbone, image features written at the
    `media_placeholder_token_id` positions."""

    config: KimiK3Config
    config_class = KimiK3Config
    text_model_class = KimiK3TextModel
    # AutoModel on a released folder: the base model takes everything but the head
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]


# K3_PREFIXES turned around (ours -> released), the longest first; the tower's MoonViT names back to the release's
_OUR_PREFIXES = sorted(((ours, released) for released, ours in K3_PREFIXES), key=lambda p: -len(p[0]))
_MOONVIT_BACK = [(re.compile(src), tgt) for src, tgt in rename_pairs(MOONVIT_NAMES, reverse=True)]
_LANGUAGE_MODEL = K3_PREFIXES[0][0]  # "language_model.model."


def _released_name(name: str, sparse_layers: set[int]) -> tuple[str, tuple | None]:
    """Our state-dict name -> (K3's released name, the released shape if it differs: (1, -1) for the Attention
    Residual queries), from the name tables of conversion_mapping_kimi_k3 (routed experts: `_released_experts`)."""
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


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor- / expert-parallel parameter (DTensor) gathered whole (a collective: every rank calls it, in the
    state dict's order); a plain tensor as it is."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def k3_state_dict(
    model: "KimiK3ForConditionalGeneration",
    experts_format: str = "mxfp4",
    state_dict: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The model's tensors under Kimi K3's released names and shapes (the inverse of the load-time conversion):
    `language_model.model.*` / `language_model.lm_head.weight` / `vision_tower.*` / `mm_projector.*`, MoE blocks as
    `block_sparse_moe` with per-expert `w1` (gate), `w3` (up), `w2` (down), Attention Residual pairs as
    `*_res_norm.weight` [d] and `*_res_proj.weight` [1, d], `A_log` zero-padded to [head_dim].
    experts_format "mxfp4": `weight_packed` / `weight_scale` (round to nearest E2M1 where a weight is not on the
    grid; lossless for weights loaded from MXFP4), "dense": `.weight` in the model's dtype (bf16 for a bf16 model),
    "lossless": MXFP4 if every expert is on the MXFP4 grid (exact), else dense (what `save_pretrained` does by default
    for a model loaded from MXFP4, so that a save never rounds a fine-tuned weight silently).
    state_dict: the model's tensors under its own names (default `model.state_dict()`; Trainer passes its own, e.g.
    accelerate's gathered FSDP state dict)."""
    if experts_format not in ("mxfp4", "dense", "lossless"):
        raise ValueError(f"experts_format must be 'mxfp4', 'dense' or 'lossless', got {experts_format!r}")
    if experts_format == "lossless":
        try:
            return _k3_state_dict(model, "exact", state_dict)
        except _OffGrid as e:
            logger.warning(
                f"{e}: the routed experts are no longer on the MXFP4 grid (trained?), so they are saved as dense "
                "`.weight` tensors, losslessly; pass experts_format='mxfp4' to round them to MXFP4 instead"
            )
            return _k3_state_dict(model, "dense", state_dict)
    return _k3_state_dict(model, experts_format, state_dict)


class _OffGrid(ValueError):
    """An expert weight that MXFP4 cannot hold exactly (k3_state_dict's "lossless" format falls back to dense)."""


def _k3_state_dict(model, experts_format: str, state_dict) -> dict[str, torch.Tensor]:
    """k3_state_dict's conversion; experts_format "mxfp4", "exact" (MXFP4, raising _OffGrid) or "dense"."""
    text = model.config.text_config
    sparse = {i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"}
    out = {}
    state = model.state_dict() if state_dict is None else state_dict
    for name, tensor in state.items():
        if name.endswith(_SCALE) and name[: -len(_SCALE)].rpartition(".")[2] in EXPERT_WEIGHTS:
            continue  # a resident expert's E8M0 scales: written with its packed bytes
        tensor = _full(tensor.detach())
        key, shape = _released_name(name, sparse)
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
                out, base, leaf, tensor, _full(state[name + _SCALE].detach()), experts_format, model
            )
            continue
        if base.endswith(".experts") and leaf in EXPERT_WEIGHTS:
            names = EXPERT_WEIGHTS[leaf]  # the stacked rows are the experts' weights in this order
            parts = dict(zip(names, tensor.chunk(len(names), dim=1)))
            for w, stacked in parts.items():
                for e in range(stacked.shape[0]):
                    expert = f"{base}.{e}.{w}"
                    if experts_format in ("mxfp4", "exact"):
                        try:
                            packed, scale = quantize_mxfp4(stacked[e], name=expert, exact=experts_format == "exact")
                        except ValueError as err:
                            if experts_format == "exact" and "not MXFP4-representable" in str(err):
                                raise _OffGrid(expert) from None
                            raise
                        out[expert + ".weight_packed"], out[expert + ".weight_scale"] = packed, scale
                    else:
                        out[expert + ".weight"] = stacked[e].contiguous()
            continue
        out[key] = tensor
    return out


_SCALE = "_scale"  # KimiHybridMxfp4Experts: `gate_up_proj` holds the packed bytes, `gate_up_proj_scale` the scales


def _released_mxfp4_experts(out, base, leaf, packed, scale, experts_format, model) -> None:
    """A resident layer's stacked MXFP4 bytes (packed [E, rows, in / 2], scale [E, rows, in / 32]) as the release's
    per-expert tensors: the bytes themselves for "mxfp4" / "exact" (bit for bit: they are what was loaded), decoded
    into the model's dtype for "dense"."""
    names = EXPERT_WEIGHTS[leaf]
    for w, p, s in zip(names, packed.chunk(len(names), dim=1), scale.chunk(len(names), dim=1)):
        for e in range(p.shape[0]):
            expert = f"{base}.{e}.{w}"
            if experts_format == "dense":
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
def load_k3_state_dict(model: "KimiK3ForConditionalGeneration", state_dict: dict) -> tuple[set, set]:
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


class KimiK3ForConditionalGeneration(KimiK3ExpertsFormatMixin, KimiHybridForConditionalGeneration):
    """Kimi K3 with its language-model head (untied, `language_model.lm_head` in the release)."""

    config: KimiK3Config
    config_class = KimiK3Config
    model_class = KimiK3Model

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """Under tensor parallelism MXFP4 experts are sharded before they are decoded: each rank's slice of
        down_proj's input (moe_intermediate_size / tp) must hold whole 32-value scale blocks."""
        text = model.config.text_config
        if (
            distributed_config is not None
            and distributed_config.tp_size > 1
            and distributed_config.ep_size <= 1
            and experts_are_mxfp4(text)
            and text.moe_intermediate_size % (32 * distributed_config.tp_size)
        ):
            raise ValueError(
                f"moe_intermediate_size {text.moe_intermediate_size} / tp_size {distributed_config.tp_size} is not a "
                "multiple of 32, the MXFP4 scale block of the released experts: a rank's slice of each expert's w2 "
                "would split a block (use another tp_size, ep_size=tp_size, or a dequantised copy: kimi-hf convert k3)"
            )
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)

    def adjust_generation_fn(self, generation_config, from_auto_class, from_pipeline, path, *args, **kwargs):
        """Without a generation_config.json, transformers builds the generation config from config.json's raw
        text_config, where the release keeps transformers 4.x's generation defaults in full (`max_length: 20`,
        ...: boilerplate of the writer, not settings; they would cap or override every `generate`). The
        generation config then comes from the parsed config instead: bos, eos <|end_of_msg|>, pad."""
        super().adjust_generation_fn(generation_config, from_auto_class, from_pipeline, path, *args, **kwargs)
        if generation_config is not None or path is None:
            return
        from transformers import GenerationConfig
        from transformers.utils import cached_file

        subfolder = kwargs.get("subfolder") or ""
        if os.path.isdir(path):
            found = os.path.isfile(os.path.join(path, subfolder, "generation_config.json"))
        else:
            options = {
                k: kwargs.get(k) for k in ("cache_dir", "revision", "token", "local_files_only") if kwargs.get(k)
            }
            try:
                found = cached_file(
                    path,
                    "generation_config.json",
                    subfolder=subfolder,
                    _raise_exceptions_for_missing_entries=False,
                    **options,
                )
            except (OSError, ValueError):  # offline, or no such repository: as if there were none
                found = None
            found = found is not None
        if not found:
            self.generation_config = GenerationConfig.from_model_config(self.config)

    def save_pretrained(
        self,
        save_directory,
        *args,
        experts_format: str | None = None,
        state_dict: dict | None = None,
        save_original_format: bool = True,
        **kwargs,
    ):
        """Writes Kimi K3's released layout (`k3_state_dict`) and a config in the released field names, with every
        keyword of transformers' `save_pretrained` (Trainer's `state_dict=`, `max_shard_size`, `is_main_process`, ...).
        experts_format: "mxfp4" (compressed-tensors mxfp4-pack-quantized, as released: weights off the MXFP4 grid,
        e.g. after fine-tuning, round to nearest), "dense" (plain `.weight` tensors in the model's dtype; the saved
        text_config then has no quantization_config), or None: as loaded, losslessly (MXFP4 when the config says so
        and the experts are still on its grid, else dense with a warning), so that Trainer's checkpoints resume
        bit for bit.
        state_dict: the tensors to write under the model's own names (default: the model's); converted likewise.
        save_original_format=False: transformers' in-memory layout instead (our names, dense experts), which
        from_pretrained reads too."""
        text = self.config.text_config
        if not save_original_format:
            if text.experts_format == "mxfp4":
                raise ValueError(
                    "save_original_format=False writes transformers' in-memory layout with dense experts, but this "
                    "model keeps them in MXFP4 (experts_format='mxfp4'): save the released layout (the default), or "
                    "load the model with experts_format='dense'"
                )
            if experts_format not in (None, "dense"):
                raise ValueError(
                    f"save_original_format=False writes dense experts, not experts_format={experts_format!r}"
                )
            with _experts_quantization(text, None):
                return super().save_pretrained(
                    save_directory, *args, state_dict=state_dict, save_original_format=False, **kwargs
                )
        if experts_format is None and text.experts_format == "mxfp4":
            experts_format = "mxfp4"  # the resident bytes, written back as they are
        elif experts_format is None:
            experts_format = "lossless" if experts_are_mxfp4(text) else "dense"
        state = k3_state_dict(self, experts_format, state_dict)
        mxfp4 = any(k.endswith(".weight_packed") for k in state)
        with _experts_quantization(text, K3_MXFP4_QUANTIZATION_CONFIG if mxfp4 else None):
            return super().save_pretrained(
                save_directory, *args, state_dict=state, save_original_format=False, **kwargs
            )

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's load_state_dict, which also reads Kimi K3's released layout (what save_pretrained writes, so what
        Trainer's checkpoints hold: `resume_from_checkpoint` loads them through this, shard by shard). Released
        tensors are converted by the same checkpoint conversion mapping as from_pretrained and copied into the
        existing parameters in place (an optimizer built on them keeps them); each routed expert is decoded into
        its slice of the stacked experts, so a layer's experts may come in several calls (shards)."""
        if not any(k.startswith(RELEASED_PREFIXES) for k in state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        missing, unexpected = load_k3_state_dict(self, state_dict)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {sorted(missing)}, "
                f"unexpected keys {sorted(unexpected)}"
            )
        return torch.nn.modules.module._IncompatibleKeys(sorted(missing), sorted(unexpected))


@contextlib.contextmanager
def _experts_quantization(text_config, value):
    """The text config says how the experts are stored while it is written, then what it said before."""
    before = text_config.experts_quantization_config
    text_config.experts_quantization_config = value
    try:
        yield
    finally:
        text_config.experts_quantization_config = before


__all__ = [
    "K3_LORA_TARGET_MODULES",
    "KimiK3ExpertsFormatMixin",
    "KimiK3TextModel",
    "KimiK3ForCausalLM",
    "KimiK3Model",
    "KimiK3ForConditionalGeneration",
    "k3_state_dict",
]
