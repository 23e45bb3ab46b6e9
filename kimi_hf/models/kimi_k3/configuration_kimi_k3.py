"""Configurations of Kimi K3 (`moonshotai/Kimi-K3`, July 2026) as released: `KimiK3Config` (model_type
"kimi_k3") with a `KimiK3TextConfig` (the released text_config says model_type "kimi_linear") and a
`KimiK3VisionConfig` (MoonViT3d + patchmergerv2).

The text config is the hybrid model's config (`KimiHybridTextConfig`, which reads Moonshot's field names
and K3's options: SiTU, the KDA safe gate and full-rank output gate, the MLA output gate, Stable LatentMoE,
Block Attention Residuals counted in layers) with K3's sizes as defaults. Both configs serialise back to the
released field names and values (`to_dict`), so that a saved folder reads like Moonshot's for vLLM, SGLang
and llama.cpp.
"""

import copy
import json

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import SubConfigSpec

from ..kimi_hybrid.configuration_kimi_hybrid import KimiHybridConfig, KimiHybridTextConfig, kimi_linear_layer_types
from ..kimi_hybrid.configuration_kimi_hybrid_vision import EXTRA_ATTRIBUTES_KEY, with_extra_attributes
from .configuration_kimi_k3_vision import KimiK3VisionConfig
from .xtml_kimi_k3 import IMAGE_PLACEHOLDER


# The compressed-tensors scheme of K3's routed experts (text_config.quantization_config of the release)
K3_MXFP4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "global_compression_ratio": None,
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "float",
                "group_size": 32,
                "strategy": "group",
                "symmetric": True,
                "dynamic": False,
                "scale_dtype": "torch.uint8",
                "zp_dtype": None,
                "observer": "minmax",
                "observer_kwargs": {},
                "actorder": None,
                "block_structure": None,
            },
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
}


EXPERTS_FORMATS = ("auto", "mxfp4", "dense")


def experts_are_mxfp4(text_config) -> bool:
    """Whether a K3 text config says its routed experts are stored MXFP4-packed (compressed-tensors)."""
    q = getattr(text_config, "experts_quantization_config", None)
    if q is None:
        return False
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != "mxfp4-pack-quantized":
        raise ValueError(
            "text_config.quantization_config: only compressed-tensors 'mxfp4-pack-quantized' routed experts (Kimi "
            f"K3's release) are supported, got quant_method={q.get('quant_method')!r}, format={q.get('format')!r}"
        )
    return True


@strict
class KimiK3TextConfig(KimiHybridTextConfig):
    r"""Kimi K3's text backbone: 93 layers (69 KDA with the safe gate and a full-rank output gate, 24 MLA with
    q LoRA and an output gate, 3:1 plus MLA last), SiTU-GLU FFNs, Stable LatentMoE (896 experts, top 16, latent
    3584, 2 shared), Block Attention Residuals every 12 layers. Defaults are the released values; every field
    of the released text_config is read (see `KimiHybridTextConfig`), and `to_dict` writes them back."""

    model_type = "kimi_k3_text"
    base_config_key = "text_config"

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 33792
    moe_intermediate_size: int = 3072
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    num_experts: int = 896
    num_experts_per_tok: int = 16
    n_shared_experts: int = 2
    routed_scaling_factor: float = 1.0
    linear_num_heads: int = 96
    hidden_act: str = "situ"
    activation_situ_beta: float | None = 4.0
    activation_situ_linear_beta: float | None = 25.0
    kda_full_rank_output_gate: bool = True
    kda_gate_lower_bound: float | None = -5.0
    mla_use_output_gate: bool = True
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    attn_residual: str = "block"
    attn_residual_block_size: int | None = 24  # sublayers: K3's attn_res_block_size 12 layers
    attn_residual_query_init: str = "normal"

    def __post_init__(self, **kwargs):
        # The released text_config's quantization_config describes how the routed experts are stored (MXFP4); the
        # checkpoint conversion dequantises them at load, so it is kept under another name: transformers would
        # otherwise look for the compressed-tensors quantizer (and its package) at from_pretrained.
        self.experts_quantization_config = kwargs.pop("quantization_config", None)
        experts_are_mxfp4(self)  # refuses another scheme now, by name
        self._experts_format = "dense"  # in memory; a runtime setting, never serialised (see experts_format)
        if "attn_res_block_size" in kwargs and kwargs["attn_res_block_size"] is None:  # released null: the residual
            self.attn_residual, self.attn_residual_block_size = "none", None
        super().__post_init__(**kwargs)

    def _validate(self):
        super()._validate()
        if self.attn_residual != "none" and (
            self.attn_residual != "block" or (self.resolved_attn_residual_block_size() or 0) % 2
        ):
            raise ValueError(
                "a K3 text config counts Attention Residual blocks in layers (attn_res_block_size): "
                f"attn_residual must be 'block' with an even sublayer block size, got {self.attn_residual!r} / "
                f"{self.attn_residual_block_size!r}"
            )
        dense = [t == "dense" for t in self.mlp_layer_types]
        k = dense.index(False) if False in dense else len(dense)
        if any(dense[k:]):
            raise ValueError(
                "a K3 text config has dense FFNs only in the first layers (first_k_dense_replace): "
                f"mlp_layer_types {self.mlp_layer_types}"
            )

    @property
    def experts_format(self) -> str:
        """How the model holds its routed experts in memory: "dense" (stacked weights of the model's dtype, trainable)
        or "mxfp4" (the released MXFP4 bytes, frozen, dequantised on the fly: KimiHybridMxfp4Experts). Set by
        `from_pretrained(..., experts_format=)` before the model is built; "auto" resolves to "mxfp4" when the config
        says the experts are stored in MXFP4 (quantization_config), else "dense". Not written to config.json."""
        return self._experts_format

    @experts_format.setter
    def experts_format(self, value: str) -> None:
        if value not in EXPERTS_FORMATS:
            raise ValueError(f"experts_format must be one of {EXPERTS_FORMATS}, got {value!r}")
        stored = experts_are_mxfp4(self)
        if value == "auto":
            value = "mxfp4" if stored else "dense"
        elif value == "mxfp4" and not stored:
            raise ValueError(
                "experts_format='mxfp4' keeps the routed experts as their MXFP4 bytes, but this config's experts are "
                "not stored in MXFP4 (text_config has no compressed-tensors quantization_config): use "
                "experts_format='dense', or save the model with save_pretrained(..., saved_experts='mxfp4') first"
            )
        self._experts_format = value

    def to_json_string(self, use_diff: bool = True) -> str:
        """A text config saved on its own (KimiK3ForCausalLM's config.json): the released field names and values
        under this class's model_type (a top-level "kimi_linear" would be read as transformers' own Kimi Linear).
        to_dict stays the released text_config, as it is nested in K3's config.json."""
        out = self.to_dict()
        # a text model saved alone holds its experts dense (KimiK3TextModel / KimiK3ForCausalLM): no MXFP4 scheme
        out.pop("quantization_config", None)
        out["model_type"] = self.model_type
        out["architectures"] = list(self.architectures or ["KimiK3ForCausalLM"])
        for name in ("auto_map", "transformers_version"):
            if getattr(self, name, None):
                out[name] = copy.deepcopy(getattr(self, name))
        return json.dumps(out, indent=2, sort_keys=True) + "\n"

    def to_dict(self) -> dict:
        """The released text_config's field names and values (model_type "kimi_linear", 1-based layer lists), then
        the instance's extra attributes (with_extra_attributes)."""
        kda = [i + 1 for i, t in enumerate(self.layer_types) if t == "linear_attention"]
        mla = [i + 1 for i, t in enumerate(self.layer_types) if t == "full_attention"]
        block = self.resolved_attn_residual_block_size()
        out = {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "activation_situ_beta": self.activation_situ_beta,
            "activation_situ_linear_beta": self.activation_situ_linear_beta,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "max_position_embeddings": self.max_position_embeddings,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "mla_use_output_gate": self.mla_use_output_gate,
            "linear_attn_config": {
                "num_heads": self.linear_num_heads,
                "head_dim": self.linear_head_dim,
                "short_conv_kernel_size": self.linear_conv_kernel_dim,
                "use_full_rank_gate": self.kda_full_rank_output_gate,
                "gate_lower_bound": self.kda_gate_lower_bound,
                "full_attn_layers": mla,
                "kda_layers": kda,
            },
            "attn_res_block_size": None if block is None else block // 2,
            "first_k_dense_replace": self.mlp_layer_types.count("dense"),
            "moe_layer_freq": 1,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_tok,
            "num_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "latent_moe_use_norm": self.latent_moe_use_norm,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": True,
            "num_expert_group": self.n_group,
            "topk_group": self.topk_group,
            "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": self.use_cache,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.dtype is not None:
            out["dtype"] = str(self.dtype).removeprefix("torch.")
        if self.experts_quantization_config is not None:
            out["quantization_config"] = dict(self.experts_quantization_config)
        if self.loss_chunk_size is not None:  # a training setting of ours, not a released field: only when set
            out["loss_chunk_size"] = self.loss_chunk_size
        return with_extra_attributes(self, out)

    def to_diff_dict(self) -> dict:
        return self.to_dict()  # every released field, always (engines read them, defaults differ between codes)


@strict
class KimiK3Config(KimiHybridConfig):
    r"""Kimi K3 (`KimiK3ForConditionalGeneration`): the K3 text backbone, the MoonViT3d vision tower and the
    patchmergerv2 projector, image features at the `media_placeholder_token_id` positions (early fusion).
    Reads the released config.json field by field; `to_dict` writes the released names back."""

    model_type = "kimi_k3"
    sub_configs_defaults = {
        "text_config": SubConfigSpec(config_class=KimiK3TextConfig),
        "vision_config": SubConfigSpec(config_class=KimiK3VisionConfig),
    }
    attribute_map = {"media_placeholder_token_id": "image_token_id"}

    image_token_id: int = 163605
    image_placeholder: str = IMAGE_PLACEHOLDER
    ignore_index: int = -100
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    pad_token_id: int | None = 163839

    def __post_init__(self, **kwargs):
        if "media_placeholder_token_id" in kwargs:
            self.image_token_id = kwargs.pop("media_placeholder_token_id")
        kwargs.pop(EXTRA_ATTRIBUTES_KEY, None)  # the extras themselves stay in kwargs: they become attributes
        kwargs.pop("model_type", None)
        super().__post_init__(**kwargs)
        # the projector's post-norm eps lives in the released vision_config (projector_ln_eps)
        self.projection_layer_norm_eps = getattr(self.vision_config, "projector_layer_norm_eps", 1e-5)

    def to_dict(self) -> dict:
        out = {
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "ignore_index": self.ignore_index,
            "media_placeholder_token_id": self.image_token_id,
            "image_placeholder": self.image_placeholder,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": self.text_config.to_dict(),
            "vision_config": self.vision_config.to_dict(),
        }
        if self.dtype is not None:
            out["dtype"] = str(self.dtype).removeprefix("torch.")
        if getattr(self, "auto_map", None):
            out["auto_map"] = dict(self.auto_map)
        if getattr(self, "transformers_version", None):
            out["transformers_version"] = self.transformers_version
        return with_extra_attributes(self, out)

    def to_diff_dict(self) -> dict:
        return self.to_dict()


__all__ = [
    "EXPERTS_FORMATS",
    "K3_MXFP4_QUANTIZATION_CONFIG",
    "KimiK3Config",
    "KimiK3TextConfig",
    "experts_are_mxfp4",
    "kimi_linear_layer_types",
]
