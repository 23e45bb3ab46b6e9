"""Kimi K3 (`moonshotai/Kimi-K3`) as transformers classes: the hybrid model's layers with K3's options
(configuration_kimi_k3.py), loading Moonshot's released folders directly.

`KimiK3ForConditionalGeneration.from_pretrained(k3_dir)` reads the released layout through transformers'
checkpoint conversion mapping (conversion_mapping_kimi_hybrid.k3_mapping): the `language_model.` /
`vision_tower.` / `mm_projector.` prefixes, K3's Attention Residual names, per-expert MXFP4 `w1/w2/w3`
dequantised (losslessly) and stacked while each shard loads, `A_log` [head_dim] narrowed to its heads.
`save_pretrained` writes that layout back (`k3_state_dict`, state_dict_kimi_k3.py: the released layout's adapter):
official names and shapes, the release's dtypes for the router weight, experts re-packed as MXFP4 or written as plain
`.weight` tensors (the config then says so).
"""

import contextlib
import os

import torch

from ..kimi_hybrid.modeling_kimi_hybrid import KimiHybridForCausalLM, KimiHybridTextModel
from ..kimi_hybrid.modeling_kimi_hybrid_multimodal import KimiHybridForConditionalGeneration, KimiHybridModel
from .configuration_kimi_k3 import (
    EXPERTS_FORMATS,
    K3_MXFP4_QUANTIZATION_CONFIG,
    KimiK3Config,
    KimiK3TextConfig,
    experts_are_mxfp4,
)
from .conversion_mapping_kimi_k3 import register_k3 as _register_k3_conversion_mapping

# the released layout's adapter (its own module; imported here so that saved folders ship it, and for the old paths)
from .state_dict_kimi_k3 import (  # noqa: F401  (check_mxfp4_headers ... were defined here)
    RELEASED_PREFIXES,
    SAVED_EXPERTS,
    check_mxfp4_headers,
    k3_state_dict,
    load_k3_state_dict,
    released_key_mapping,
    released_name,
)


_register_k3_conversion_mapping()

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
    # PEFT's key map for adapters saved in the release's names (PeftModel.from_pretrained reads it): text only
    _checkpoint_conversion_mapping = released_key_mapping(text_only=True)


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


class KimiK3ForConditionalGeneration(KimiK3ExpertsFormatMixin, KimiHybridForConditionalGeneration):
    """Kimi K3 with its language-model head (untied, `language_model.lm_head` in the release)."""

    config: KimiK3Config
    config_class = KimiK3Config
    model_class = KimiK3Model
    # PEFT's key map for adapters saved in the release's names (kimi_hf.adapters_released): PeftModel.from_pretrained
    # reads it (transformers' load_adapter maps them through the conversion mapping above)
    _checkpoint_conversion_mapping = released_key_mapping()

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
        saved_experts: str | None = None,
        state_dict: dict | None = None,
        save_original_format: bool = True,
        **kwargs,
    ):
        """Writes Kimi K3's released layout (`k3_state_dict`) and a config in the released field names, with every
        keyword of transformers' `save_pretrained` (Trainer's `state_dict=`, `max_shard_size`, `is_main_process`, ...).
        saved_experts, how the routed experts are written (`experts_format` is how the model holds them in memory):
        "mxfp4" (compressed-tensors mxfp4-pack-quantized, as released: weights off the MXFP4 grid,
        e.g. after fine-tuning, round to nearest), "dense" (plain `.weight` tensors in the model's dtype; the saved
        text_config then has no quantization_config), or None: as loaded, losslessly (MXFP4 when the config says so
        and the experts are still on its grid, else dense with a warning), so that Trainer's checkpoints resume
        bit for bit.
        state_dict: the tensors to write under the model's own names (default: the model's); converted likewise.
        save_original_format=False: transformers' in-memory layout instead (our names, dense experts), which
        from_pretrained reads too."""
        if "experts_format" in kwargs:
            raise TypeError(
                "save_pretrained() takes saved_experts= ('mxfp4', 'dense' or 'lossless'), not experts_format=: "
                "experts_format is how from_pretrained holds the experts in memory"
            )
        text = self.config.text_config
        if not save_original_format:
            if text.experts_format == "mxfp4":
                raise ValueError(
                    "save_original_format=False writes transformers' in-memory layout with dense experts, but this "
                    "model keeps them in MXFP4 (experts_format='mxfp4'): save the released layout (the default), or "
                    "load the model with experts_format='dense'"
                )
            if saved_experts not in (None, "dense"):
                raise ValueError(
                    f"save_original_format=False writes dense experts, not saved_experts={saved_experts!r}"
                )
            with _experts_quantization(text, None):
                return super().save_pretrained(
                    save_directory, *args, state_dict=state_dict, save_original_format=False, **kwargs
                )
        if saved_experts is None and text.experts_format == "mxfp4":
            saved_experts = "mxfp4"  # the resident bytes, written back as they are
        elif saved_experts is None:
            saved_experts = "lossless" if experts_are_mxfp4(text) else "dense"
        state = k3_state_dict(self, saved_experts, state_dict)
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
