"""Tiny random Kimi K3 checkpoints in the released layout (config.json + sharded safetensors + index).

Written independently of ``kimi_hf``: only torch, safetensors, json and the stdlib. Everything here follows the
K3 fact sheet (config §1, tensor inventory §4.2, MXFP4 §4.3, gotchas §5); comments cite the fact they rely on.

Public API
----------
``tiny_k3_config(**overrides) -> dict``
    A config.json dict shaped like the released one, with tiny sizes.
``write_k3_checkpoint(folder, config, *, seed, mxfp4, shards, dtype) -> dict[str, Tensor]``
    Writes the checkpoint and returns the *logical* tensors (fp32, dequantised) by official name.
``pack_mxfp4`` / ``mxfp4_from_codes`` / ``dequantize_mxfp4`` / ``e2m1_decode``
    An own MXFP4 (compressed-tensors ``mxfp4-pack-quantized``) packer and decoder.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Iterator

import torch
from safetensors.torch import save_file


# --------------------------------------------------------------------------------------------------------------
# MXFP4 (§4.3): E2M1 nibbles, two per byte (low nibble = element 2j), one E8M0 exponent per 32 input elements.
# --------------------------------------------------------------------------------------------------------------

E2M1_LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP_SIZE = 32
E8M0_BIAS = 127


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibble codes (any int dtype, values 0..15) -> float32 of the same shape.

    ``value = (-1)^(bit 3) * LUT[code & 7]`` with ``LUT = [0, 0.5, 1, 1.5, 2, 3, 4, 6]``.
    """
    codes = codes.to(torch.int64)
    if codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("E2M1 codes must lie in 0..15")
    magnitude = torch.tensor(E2M1_LUT, dtype=torch.float32)[codes & 7]
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).to(torch.float32)
    return magnitude * sign


def e8m0_scale(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 (UE8M0) scale bytes -> float32 powers of two ``2^(s - 127)`` (exact)."""
    return torch.exp2(exponents.to(torch.float32) - E8M0_BIAS)


def mxfp4_from_codes(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The logical weight of an MXFP4 tensor, computed from its nibble codes.

    codes: [out, in] uint8 in 0..15; exponents: [out, in/32] uint8 -> [out, in] float32, exact:
    ``W[r, c] = E2M1(code[r, c]) * 2^(exponents[r, c // 32] - 127)``.
    """
    out_features, in_features = codes.shape
    if in_features % MXFP4_GROUP_SIZE or exponents.shape != (out_features, in_features // MXFP4_GROUP_SIZE):
        raise ValueError(f"codes {tuple(codes.shape)} and exponents {tuple(exponents.shape)} do not match")
    scale = e8m0_scale(exponents).repeat_interleave(MXFP4_GROUP_SIZE, dim=1)  # [out, in]
    return e2m1_decode(codes) * scale


def pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack E2M1 codes [out, in] (0..15) and E8M0 exponents [out, in/32] into the released tensors.

    Returns ``(weight_packed [out, in/2] uint8, weight_scale [out, in/32] uint8)``; byte j of a row holds element 2j
    in the low nibble and element 2j+1 in the high nibble (K3 release: ``packed = e[2j] | e[2j+1] << 4``).
    """
    out_features, in_features = codes.shape
    if in_features % MXFP4_GROUP_SIZE or exponents.shape != (out_features, in_features // MXFP4_GROUP_SIZE):
        raise ValueError(f"codes {tuple(codes.shape)} and exponents {tuple(exponents.shape)} do not match")
    codes = codes.to(torch.uint8)
    if codes.numel() and codes.max() > 15:
        raise ValueError("E2M1 codes must lie in 0..15")
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), exponents.to(torch.uint8).contiguous()


def unpack_mxfp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """weight_packed [out, in/2] uint8 -> codes [out, in] uint8 (low nibble first)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def dequantize_mxfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """Decode released MXFP4 bytes: weight_packed [out, in/2] uint8, weight_scale [out, in/32] uint8 -> [out, in] fp32."""
    return mxfp4_from_codes(unpack_mxfp4_codes(weight_packed), weight_scale)


# --------------------------------------------------------------------------------------------------------------
# config.json (§1)
# --------------------------------------------------------------------------------------------------------------

# K3 release (§1.2): compressed-tensors MXFP4 for the routed experts, stored INSIDE text_config.
RELEASE_QUANTIZATION_CONFIG = {
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

# K3 release (§1.2): transformers 4.56 boilerplate in text_config, all at their defaults.
TRANSFORMERS_456_BOILERPLATE = {
    "_name_or_path": "",
    "add_cross_attention": False,
    "bad_words_ids": None,
    "begin_suppress_tokens": None,
    "chunk_size_feed_forward": 0,
    "cross_attention_hidden_size": None,
    "decoder_start_token_id": None,
    "diversity_penalty": 0.0,
    "do_sample": False,
    "early_stopping": False,
    "encoder_no_repeat_ngram_size": 0,
    "exponential_decay_length_penalty": None,
    "finetuning_task": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "is_decoder": False,
    "is_encoder_decoder": False,
    "length_penalty": 1.0,
    "max_length": 20,
    "min_length": 0,
    "no_repeat_ngram_size": 0,
    "num_beam_groups": 1,
    "num_beams": 1,
    "num_return_sequences": 1,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_scores": False,
    "prefix": None,
    "problem_type": None,
    "pruned_heads": {},
    "remove_invalid_values": False,
    "repetition_penalty": 1.0,
    "return_dict": True,
    "return_dict_in_generate": False,
    "sep_token_id": None,
    "suppress_tokens": None,
    "task_specific_params": None,
    "temperature": 1.0,
    "tf_legacy_loss": False,
    "tie_encoder_decoder": False,
    "tokenizer_class": None,
    "top_k": 50,
    "top_p": 1.0,
    "torchscript": False,
    "typical_p": 1.0,
    "use_bfloat16": False,
}

# Tiny token ids mirror the release's layout: 256 "BPE" ids, then the specials at the same offsets as
# 163584 + k ([BOS] +0, <|end_of_msg|> +2, <|media_pad|> +21), [PAD] = vocab_size - 1.
TINY_VOCAB_SIZE = 320
TINY_BOS_TOKEN_ID = 256
TINY_EOS_TOKEN_ID = 258
TINY_MEDIA_PLACEHOLDER_TOKEN_ID = 277
TINY_PAD_TOKEN_ID = 319


def k3_layer_lists(num_hidden_layers: int) -> tuple[list[int], list[int]]:
    """1-based ``(kda_layers, full_attn_layers)`` for a tiny K3.

    K3 release: every 4th layer is MLA plus the last (4, 8, …, 92, 93), so the last two layers are both MLA. The
    tiny rule keeps "every 4th" and makes the last two layers MLA explicitly (for 7 layers: MLA = [4, 6, 7]).
    """
    n = num_hidden_layers
    full = sorted(set(range(4, n + 1, 4)) | {layer for layer in (n - 1, n) if layer >= 1})
    kda = [layer for layer in range(1, n + 1) if layer not in full]
    return kda, full


def _tiny_text_config(boilerplate: bool) -> dict:
    kda_layers, full_attn_layers = k3_layer_lists(7)
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
            "AutoModel": "modeling_kimi_linear.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM",
        },
        "model_type": "kimi_linear",
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 96,
        "num_hidden_layers": 7,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-05,
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": 2,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "full_attn_layers": full_attn_layers,
            "kda_layers": kda_layers,
        },
        "attn_res_block_size": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 3,
        "num_shared_experts": 2,
        "moe_intermediate_size": 96,
        "routed_expert_hidden_size": 64,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": TINY_BOS_TOKEN_ID,
        "eos_token_id": TINY_EOS_TOKEN_ID,
        "pad_token_id": TINY_PAD_TOKEN_ID,
        "dtype": "bfloat16",
        "transformers_version": "4.56.2",
        "quantization_config": copy.deepcopy(RELEASE_QUANTIZATION_CONFIG),
    }
    if boilerplate:
        text.update(copy.deepcopy(TRANSFORMERS_456_BOILERPLATE))
    return text


def _tiny_vision_config(text_hidden_size: int) -> dict:
    # K3 release (§1.3) field set, tiny sizes; qkv_hidden_size / heads = 32 != vt_hidden_size / heads = 16.
    return {
        "_attn_implementation": "flash_attention_2",
        "patch_size": 14,
        "init_pos_emb_height": 8,
        "init_pos_emb_width": 8,
        "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear",
        "vt_hidden_size": 32,
        "vt_num_hidden_layers": 2,
        "vt_num_attention_heads": 2,
        "qkv_hidden_size": 64,
        "vt_intermediate_size": 64,
        "norm_type": "rmsnorm",
        "attn_bias": False,
        "linear_bias": False,
        "patch_embed_proj_bias": False,
        "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh",
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": 32,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": text_hidden_size,
    }


def tiny_k3_config(
    *, vision: dict | None = None, top: dict | None = None, boilerplate: bool = True, **overrides
) -> dict:
    """A tiny config.json dict shaped exactly like the released Kimi K3 one (§1).

    ``**overrides`` set text_config fields (a typo raises KeyError). ``linear_attn_config=`` is merged into the
    default one (pass only the keys to change); ``quantization_config=None`` removes it. Overriding
    ``num_hidden_layers`` without layer lists recomputes them with :func:`k3_layer_lists`. ``vision=`` /
    ``top=`` update vision_config / the top level. bos/eos/pad overrides are mirrored to the top level and
    ``hidden_size`` to ``vision_config.text_hidden_size`` (the config class overwrites it the same way, §1.1).
    """
    text = _tiny_text_config(boilerplate)
    for key, value in overrides.items():
        if key not in text:
            raise KeyError(f"unknown text_config field {key!r}")
        if key == "linear_attn_config" and value is not None:
            text[key] = {**text[key], **value}
        else:
            text[key] = copy.deepcopy(value)
    if text.get("quantization_config") is None:
        text.pop("quantization_config")
    lac = text["linear_attn_config"]
    if "num_hidden_layers" in overrides and not {"kda_layers", "full_attn_layers"} & set(
        overrides.get("linear_attn_config") or {}
    ):
        lac["kda_layers"], lac["full_attn_layers"] = k3_layer_lists(text["num_hidden_layers"])

    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "model_type": "kimi_k3",
        "dtype": "bfloat16",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "ignore_index": -100,
        "media_placeholder_token_id": TINY_MEDIA_PLACEHOLDER_TOKEN_ID,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": _tiny_vision_config(text["hidden_size"]),
    }
    config["vision_config"].update(copy.deepcopy(vision or {}))
    for key, value in (top or {}).items():
        if key not in config:
            raise KeyError(f"unknown top-level field {key!r}")
        config[key] = copy.deepcopy(value)
    _check_config(config)
    return config


def _check_config(config: dict) -> None:
    text = config["text_config"]
    lac = text["linear_attn_config"]
    n = text["num_hidden_layers"]
    both = sorted(lac["kda_layers"] + lac["full_attn_layers"])
    if both != list(range(1, n + 1)):
        raise ValueError(f"kda_layers + full_attn_layers must partition 1..{n} (1-based), got {both}")
    if lac["head_dim"] < lac["num_heads"]:
        raise ValueError("K3 stores A_log as [head_dim] padded from [num_heads]; needs head_dim >= num_heads")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if not 0 <= text[key] < text["vocab_size"]:
            raise ValueError(f"{key} outside the vocabulary")
    if not 0 <= config["media_placeholder_token_id"] < text["vocab_size"]:
        raise ValueError("media_placeholder_token_id outside the vocabulary")
    for key in ("routed_expert_hidden_size", "moe_intermediate_size"):
        width = text[key] if text[key] is not None else text["hidden_size"]
        if width % MXFP4_GROUP_SIZE:
            raise ValueError(f"{key} must be a multiple of {MXFP4_GROUP_SIZE} (MXFP4 groups run along the input dim)")


# --------------------------------------------------------------------------------------------------------------
# Tensor inventory (§4.2) and random values
# --------------------------------------------------------------------------------------------------------------

# Init kinds: ("normal", std) | ("norm",) | ("a_log", num_heads) | ("dt_bias",) | ("bias",) | ("mxfp4",)
# keep_fp32: K3 release stores A_log, dt_bias, the three *_conv1d, o_norm and e_score_correction_bias as F32 (§5.5).
_Spec = tuple[str, tuple[int, ...], tuple, bool]


def _lin(name: str, out_features: int, in_features: int, gain: float = 1.0) -> _Spec:
    return name, (out_features, in_features), ("normal", gain / math.sqrt(in_features)), False


def _norm(name: str, dim: int) -> _Spec:
    return name, (dim,), ("norm",), False


def is_kda_layer(text_config: dict, layer: int) -> bool:
    """0-based ``layer`` is KDA iff ``layer + 1`` is in the 1-based ``kda_layers`` (§5.1)."""
    lac = text_config.get("linear_attn_config")
    return lac is not None and (layer + 1) in lac["kda_layers"]


def is_moe_layer(text_config: dict, layer: int) -> bool:
    """MoE iff experts exist, ``layer >= first_k_dense_replace`` and ``layer % moe_layer_freq == 0``."""
    return (
        text_config.get("num_experts") is not None
        and layer >= text_config["first_k_dense_replace"]
        and layer % text_config.get("moe_layer_freq", 1) == 0
    )


def _kda_specs(tc: dict, p: str) -> Iterator[_Spec]:
    hidden, lac = tc["hidden_size"], tc["linear_attn_config"]
    heads, head_dim, kernel = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    width = heads * head_dim
    for x in "qkv":
        yield _lin(f"{p}{x}_proj.weight", width, hidden)
    for x in "qkv":
        yield f"{p}{x}_conv1d.weight", (width, 1, kernel), ("normal", 0.5), True
    yield _lin(f"{p}f_a_proj.weight", head_dim, hidden)  # K3: the decay gate stays low-rank (rank head_dim)
    yield _lin(f"{p}f_b_proj.weight", width, head_dim, gain=0.5)
    yield _lin(f"{p}b_proj.weight", heads, hidden)
    yield f"{p}A_log", (head_dim,), ("a_log", heads), True  # K3 release: A_log stored [head_dim], zero-padded
    yield f"{p}dt_bias", (width,), ("dt_bias",), True  # per channel (h * head_dim + d)
    if lac["use_full_rank_gate"]:
        yield _lin(f"{p}g_proj.weight", width, hidden)  # K3: full-rank output gate
    else:
        yield _lin(f"{p}g_a_proj.weight", head_dim, hidden)  # Kimi-Linear-48B: low-rank output gate
        yield _lin(f"{p}g_b_proj.weight", width, head_dim)
    yield f"{p}o_norm.weight", (head_dim,), ("norm",), True  # one [head_dim] weight shared by all heads
    yield _lin(f"{p}o_proj.weight", hidden, width)


def _mla_specs(tc: dict, p: str) -> Iterator[_Spec]:
    hidden, heads = tc["hidden_size"], tc["num_attention_heads"]
    nope, rope, v_dim = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"]
    q_rank, kv_rank = tc["q_lora_rank"], tc["kv_lora_rank"]
    if q_rank is None:
        yield _lin(f"{p}q_proj.weight", heads * (nope + rope), hidden)
    else:
        yield _lin(f"{p}q_a_proj.weight", q_rank, hidden)
        yield _norm(f"{p}q_a_layernorm.weight", q_rank)
        yield _lin(f"{p}q_b_proj.weight", heads * (nope + rope), q_rank)  # per head [nope | rope]
    yield _lin(f"{p}kv_a_proj_with_mqa.weight", kv_rank + rope, hidden)  # [latent | k_rot]
    yield _norm(f"{p}kv_a_layernorm.weight", kv_rank)
    yield _lin(f"{p}kv_b_proj.weight", heads * (nope + v_dim), kv_rank)  # per head [k_nope | v]
    if tc["mla_use_output_gate"]:
        yield _lin(f"{p}g_proj.weight", heads * v_dim, hidden)  # per-channel output gate
    yield _lin(f"{p}o_proj.weight", hidden, heads * v_dim)


def _moe_specs(tc: dict, p: str) -> Iterator[_Spec]:
    hidden, experts = tc["hidden_size"], tc["num_experts"]
    latent = tc["routed_expert_hidden_size"] or hidden
    inter = tc["moe_intermediate_size"]
    yield _lin(f"{p}gate.weight", experts, hidden)
    yield f"{p}gate.e_score_correction_bias", (experts,), ("bias",), True
    if tc["num_shared_experts"]:
        shared = inter * tc["num_shared_experts"]  # one MLP of width moe_intermediate_size * num_shared_experts
        yield _lin(f"{p}shared_experts.gate_proj.weight", shared, hidden)
        yield _lin(f"{p}shared_experts.up_proj.weight", shared, hidden)
        yield _lin(f"{p}shared_experts.down_proj.weight", hidden, shared)
    if tc["routed_expert_hidden_size"] is not None:
        yield _lin(f"{p}routed_expert_down_proj.weight", latent, hidden)
        if tc["latent_moe_use_norm"]:
            yield _norm(f"{p}routed_expert_norm.weight", latent)
        yield _lin(f"{p}routed_expert_up_proj.weight", hidden, latent)
    for e in range(experts):
        # w1 = gate, w3 = up, w2 = down (§5.17); logical names end in ".weight"
        yield f"{p}experts.{e}.w1.weight", (inter, latent), ("mxfp4",), False
        yield f"{p}experts.{e}.w2.weight", (latent, inter), ("mxfp4",), False
        yield f"{p}experts.{e}.w3.weight", (inter, latent), ("mxfp4",), False


def _layer_specs(tc: dict, layer: int) -> Iterator[_Spec]:
    hidden = tc["hidden_size"]
    p = f"language_model.model.layers.{layer}."
    yield _norm(f"{p}input_layernorm.weight", hidden)
    yield _norm(f"{p}post_attention_layernorm.weight", hidden)
    if tc["attn_res_block_size"] is not None:
        # Two independent AttnRes folds per layer (§5.8); proj normal(0, 1/sqrt(hidden)), so scores are O(1) and
        # the mix is clearly non-uniform without being one-hot (the release init 0.02 would make it ~uniform).
        for fold in ("self_attention_res", "mlp_res"):
            yield _norm(f"{p}{fold}_norm.weight", hidden)
            yield f"{p}{fold}_proj.weight", (1, hidden), ("normal", 1.0 / math.sqrt(hidden)), False
    yield from (_kda_specs if is_kda_layer(tc, layer) else _mla_specs)(tc, f"{p}self_attn.")
    if is_moe_layer(tc, layer):
        yield from _moe_specs(tc, f"{p}block_sparse_moe.")
    else:
        inter = tc["intermediate_size"]
        yield _lin(f"{p}mlp.gate_proj.weight", inter, hidden)
        yield _lin(f"{p}mlp.up_proj.weight", inter, hidden)
        yield _lin(f"{p}mlp.down_proj.weight", hidden, inter)


def _model_level_specs(tc: dict) -> Iterator[_Spec]:
    hidden, vocab = tc["hidden_size"], tc["vocab_size"]
    yield "language_model.model.embed_tokens.weight", (vocab, hidden), ("normal", 1.0), False
    yield _norm("language_model.model.norm.weight", hidden)
    if tc["attn_res_block_size"] is not None:
        yield _norm("language_model.model.output_attn_res_norm.weight", hidden)
        yield (
            "language_model.model.output_attn_res_proj.weight",
            (1, hidden),
            ("normal", 1.0 / math.sqrt(hidden)),
            False,
        )
    yield _lin("language_model.lm_head.weight", vocab, hidden)  # untied, NOT language_model.model.lm_head


def _projector_specs(vc: dict) -> Iterator[_Spec]:
    kh, kw = vc["merge_kernel_size"]
    merged = vc["mm_hidden_size"] * kh * kw
    yield _lin("mm_projector.proj.0.weight", merged, merged)
    yield _lin("mm_projector.proj.2.weight", vc["text_hidden_size"], merged)
    yield _norm("mm_projector.post_norm.weight", vc["text_hidden_size"])


def _vision_specs(vc: dict) -> Iterator[_Spec]:
    width, patch = vc["vt_hidden_size"], vc["patch_size"]
    qkv = vc.get("qkv_hidden_size") or width
    inter = vc["vt_intermediate_size"]
    yield (
        "vision_tower.patch_embed.proj.weight",
        (width, 3, patch, patch),
        ("normal", 1 / math.sqrt(3 * patch * patch)),
        False,
    )
    pos_shape = (vc["init_pos_emb_height"], vc["init_pos_emb_width"], width)
    yield "vision_tower.patch_embed.pos_emb.weight", pos_shape, ("normal", 0.5), False
    for i in range(vc["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        yield _norm(f"{p}norm0.weight", width)
        yield _norm(f"{p}norm1.weight", width)
        yield _lin(f"{p}wqkv.weight", 3 * qkv, width)
        yield _lin(f"{p}wo.weight", width, qkv)
        yield _lin(f"{p}mlp.fc0.weight", inter, width)
        yield _lin(f"{p}mlp.fc1.weight", width, inter)
    yield _norm("vision_tower.encoder.final_layernorm.weight", width)


def k3_logical_specs(config: dict) -> list[_Spec]:
    """``(logical_name, shape, init, keep_fp32)`` for every tensor, in shard order (layers, model level, projector, vision)."""
    tc, vc = config["text_config"], config["vision_config"]
    specs = [s for layer in range(tc["num_hidden_layers"]) for s in _layer_specs(tc, layer)]
    specs += [*_model_level_specs(tc), *_projector_specs(vc), *_vision_specs(vc)]
    return specs


def _random_value(init: tuple, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    kind = init[0]
    if kind == "normal":
        return torch.randn(shape, generator=gen) * init[1]
    if kind == "norm":  # non-trivial RMSNorm weights around 1
        return 1.0 + 0.2 * torch.randn(shape, generator=gen)
    if kind == "a_log":  # exp(A_log) in [0.5, 1.5] for the real heads, exact zeros beyond num_heads
        value = torch.zeros(shape)
        value[: init[1]] = torch.empty(init[1]).uniform_(0.5, 1.5, generator=gen).log()
        return value
    if kind == "dt_bias":  # with f ~ N(0, 0.5^2): safe-gate decays exp(g) mostly in ~(0.2, 0.95)
        return -2.0 + 0.5 * torch.randn(shape, generator=gen)
    if kind == "bias":  # vs sigmoid scores spread ~0.2: changes the top-k set for roughly 25-75% of the tokens
        return 0.1 * torch.randn(shape, generator=gen)
    raise ValueError(kind)


def _random_mxfp4(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E2M1 codes (all 16, incl. -0) and E8M0 exponents 127-4 .. 127-2 (scales 1/16 .. 1/4)."""
    out_features, in_features = shape
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.int64).to(torch.uint8)
    exponents = torch.randint(
        E8M0_BIAS - 4, E8M0_BIAS - 1, (out_features, in_features // MXFP4_GROUP_SIZE), generator=gen
    )
    return codes, exponents.to(torch.uint8)


def _storage_dtype(dtype) -> torch.dtype:
    resolved = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    return resolved


def shard_file_name(index: int, count: int) -> str:
    """``model-00001-of-00003.safetensors`` (1-based index, 5 digits, the HF convention)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_k3_checkpoint(
    folder: str | os.PathLike, config: dict, *, seed: int = 0, mxfp4: bool = True, shards: int = 3, dtype="bfloat16"
) -> dict[str, torch.Tensor]:
    """Write a random checkpoint in the released K3 layout and return its logical tensors.

    Files: ``config.json``, ``model-0000N-of-0000M.safetensors`` (``shards`` files, contiguous slices of the order
    layers → embed/norm/output_attn_res/lm_head → mm_projector → vision, so a layer may straddle two shards) and
    ``model.safetensors.index.json`` (``weight_map``, ``metadata.total_size`` = sum of the stored bytes).

    Stored dtypes: ``dtype`` ("bfloat16" or "float32") for everything except the K3 F32 list (A_log, dt_bias,
    q/k/v_conv1d, o_norm, e_score_correction_bias: always F32) and, with ``mxfp4``, the routed experts, stored as
    ``experts.{E}.w{1,2,3}.weight_packed`` [out, in/2] U8 + ``.weight_scale`` [out, in/32] U8. Without ``mxfp4`` the
    experts are plain ``.weight`` tensors in ``dtype`` and ``quantization_config`` is dropped from the written
    config; the expert values are the same MXFP4 grid values either way (exact in bf16), so with the same seed
    both variants have identical logical tensors. The written config's ``dtype`` fields follow ``dtype``.

    Returns ``{official logical name: fp32 tensor}``: the stored values upcast (bf16 rounding included), A_log at
    its stored [head_dim] shape, routed experts dequantised under ``experts.{E}.w{1,2,3}.weight``.
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    storage = _storage_dtype(dtype)
    gen = torch.Generator().manual_seed(seed)

    logical: dict[str, torch.Tensor] = {}
    stored: dict[str, torch.Tensor] = {}
    for name, shape, init, keep_fp32 in k3_logical_specs(config):
        if init[0] == "mxfp4":
            codes, exponents = _random_mxfp4(shape, gen)
            logical[name] = mxfp4_from_codes(codes, exponents)
            if mxfp4:
                packed, scale = pack_mxfp4(codes, exponents)
                base = name.removesuffix(".weight")
                stored[f"{base}.weight_packed"], stored[f"{base}.weight_scale"] = packed, scale
            else:
                stored[name] = logical[name].to(storage)  # lossless: <= 3 significant bits
            continue
        value = _random_value(init, shape, gen).to(torch.float32 if keep_fp32 else storage).contiguous()
        stored[name] = value
        logical[name] = value.to(torch.float32)

    written = copy.deepcopy(config)
    text = written["text_config"]
    dtype_name = str(storage).removeprefix("torch.")
    written["dtype"] = text["dtype"] = dtype_name
    if mxfp4:
        text.setdefault("quantization_config", copy.deepcopy(RELEASE_QUANTIZATION_CONFIG))
    else:
        text.pop("quantization_config", None)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(written, f, indent=2, sort_keys=True)
        f.write("\n")

    _write_shards(folder, stored, shards)
    return logical


def _write_shards(folder: str, stored: dict[str, torch.Tensor], shards: int) -> None:
    names = list(stored)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must lie in 1..{len(names)}")
    bounds = [round(i * len(names) / shards) for i in range(shards + 1)]
    weight_map: dict[str, str] = {}
    total_size = 0
    for i in range(shards):
        file_name = shard_file_name(i + 1, shards)
        chunk = {name: stored[name] for name in names[bounds[i] : bounds[i + 1]]}
        save_file(chunk, os.path.join(folder, file_name), metadata={"format": "pt"})
        for name, tensor in chunk.items():
            weight_map[name] = file_name
            total_size += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------------------------------------------
# The release's tokenizer and image-processor files (§3.10): tiktoken.model ("base64(token) rank" lines), the
# added tokens at offsets from the number of ranks (special unless marked), preprocessor_config.json with its
# settings nested under media_proc_cfg and an auto_map to the release's own remote code.
# --------------------------------------------------------------------------------------------------------------

K3_ADDED_TOKENS = {  # offset: (content, special), as K3.md §3.10 lists them
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|end_of_msg|>", True),
    3: ("<|open|>", True),
    4: ("<|close|>", False),
    5: ("<|sep|>", False),
    6: ("[start_header_id]", True),
    7: ("[end_header_id]", True),
    9: ("[EOT]", True),
    18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True),
    20: ("<|media_end|>", True),
    21: ("<|media_pad|>", True),
    65: ("<osagent_mode>", True),
    254: ("[UNK]", True),
    255: ("[PAD]", True),
}
K3_RESERVED = 256

# a tiny config whose ids follow a 256-rank byte vocabulary (the tokenizer below): vocab 256 + 256 added
TINY_CHAT_IDS = {"vocab_size": 512, "bos_token_id": 256, "eos_token_id": 258, "pad_token_id": 511}
TINY_CHAT_MEDIA_PAD_ID = 256 + 21


def tiny_k3_chat_config(**overrides) -> dict:
    """`tiny_k3_config` with the token ids of `write_k3_tokenizer_files`' vocabulary (<|end_of_msg|> = eos)."""
    return tiny_k3_config(**{**TINY_CHAT_IDS, **overrides}, top={"media_placeholder_token_id": TINY_CHAT_MEDIA_PAD_ID})


def write_k3_tokenizer_files(folder: str | os.PathLike, merges: tuple[bytes, ...] = ()) -> int:
    """Writes the release's tokenizer files: tiktoken.model (the 256 single bytes, then `merges`, in rank order)
    and tokenizer_config.json (added_tokens_decoder; the release's tokenizer_class / auto_map point at its remote
    code). Returns the number of ranks (the first added token's id)."""
    import base64

    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    ranks = [bytes([b]) for b in range(256)] + list(merges)
    with open(os.path.join(folder, "tiktoken.model"), "wb") as f:
        for rank, token in enumerate(ranks):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    n = len(ranks)
    decoder = {
        str(n + k): {
            "content": K3_ADDED_TOKENS.get(k, (f"<|reserved_token_{n + k}|>", True))[0],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": K3_ADDED_TOKENS.get(k, ("", True))[1],
        }
        for k in range(K3_RESERVED)
    }
    config = {
        "added_tokens_decoder": decoder,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1048576,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return n


def write_k3_preprocessor_config(folder: str | os.PathLike, **media_proc_cfg) -> None:
    """The release's preprocessor_config.json: no image_processor_type, settings under media_proc_cfg."""
    settings = {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "in_patch_limit": 65536,
        "patch_limit_on_one_side": 512,
        "fixed_output_tokens": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        **media_proc_cfg,
    }
    config = {
        "auto_map": {"AutoImageProcessor": "kimi_k3_vision_processing.KimiK3VisionProcessor"},
        "media_proc_cfg": settings,
    }
    with open(os.path.join(os.fspath(folder), "preprocessor_config.json"), "w") as f:
        json.dump(config, f, indent=2)
