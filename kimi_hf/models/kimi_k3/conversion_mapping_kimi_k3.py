"""Load-time conversion of Kimi K3's released layout (`moonshotai/Kimi-K3`) into KimiK3ForConditionalGeneration,
through transformers' checkpoint conversion mapping: Kimi Linear's transforms (conversion_mapping_kimi_hybrid)
plus K3's prefixes, Attention Residual names, the MoonViT tower's names and the MXFP4 routed experts.

This folder is copied flat into Hub repos: imports are torch, transformers and the stdlib only.
"""

import re

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import ConversionOps, WeightRenaming

from ...mx_block import MX_BLOCK
from ..kimi_hybrid.conversion_mapping_kimi_hybrid import (
    EXPERT_WEIGHTS,
    Flatten,
    LoadOnlyConverter,
    LoadOnlyRenaming,
    kimi_linear_mapping,
    moonvit_key_mapping,
)


# only the root class: a nested KimiK3Model with its own registration would apply the transforms twice
K3_REGISTERED_CLASSES = ("KimiK3ForConditionalGeneration", "KimiK3Model")

# Kimi K3's released names -> KimiK3ForConditionalGeneration's: the one declaration both directions come from
# (the load-time renames of `k3_mapping`, the save of `k3_state_dict`). Top-level prefixes:
K3_PREFIXES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),  # then the tower's MoonViT names (MOONVIT_NAMES)
    ("mm_projector.", "model.mm_projector."),  # KimiHybridMultimodalProjectorV2 names its parameters as released
)
# Block Attention Residuals: released `{name}_norm.weight` [d] and `{name}_proj.weight` [1, d] -> our module's
# `key_norm.weight` [d] and `query` [d]
K3_RES_NAMES = (("self_attention_res", "attn_res"), ("mlp_res", "mlp_res"), ("output_attn_res", "final_res"))
K3_RES_PARAMS = (("_norm.weight", ".key_norm.weight"), ("_proj.weight", ".query"))


def _as_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' loader casts every checkpoint tensor to its target parameter's dtype before the conversion
    ops run; uint8 values survive any float cast exactly (0..255 are exact even in bf16), so they are cast back."""
    if t.dtype == torch.uint8 or not t.is_floating_point():
        return t
    back = t.to(torch.uint8)
    if not torch.equal(back.to(t.dtype), t):
        raise ValueError(f"{name}: MXFP4 tensors must hold uint8 values, got non-byte {t.dtype} values")
    return back


def mxfp4_bytes(
    packed: torch.Tensor, scale: torch.Tensor, name: str, expected_shape
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's MXFP4 pair as uint8 tensors (`_as_bytes`), checked (ops/mxfp4.check_mxfp4: shapes of one
    [out, in] = expected_shape weight, no NaN scale byte), before it is stacked or decoded."""
    from ...ops.mxfp4 import check_mxfp4

    packed, scale = _as_bytes(packed, name), _as_bytes(scale, name)
    check_mxfp4(packed, scale, name, expected_shape=expected_shape)
    return packed, scale


class DequantizeMxfp4(ConversionOps):
    """Kimi K3's MXFP4 routed experts (compressed-tensors mxfp4-pack-quantized) to the model's stacked experts, in one
    pass over each expert's `*.weight_packed` [out, in/2] uint8 and `*.weight_scale` [out, in/32] (w1 rows then w3
    rows for gate_up_proj, as the source patterns are ordered; w2 alone for down_proj), checked first (shapes, no NaN
    scale byte). Into a floating target (experts_format="dense") each expert is decoded, losslessly, straight into
    its slice of [E, sum of outs, in]; into a uint8 target (experts_format="mxfp4": KimiHybridMxfp4Experts) the bytes
    are stacked as they are, packed into the target and scales into `<target>_scale`. Either way one layer's experts
    exist once while they load (no stacked copy, no concatenation copy) and each source goes once it is used."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        from ...ops.mxfp4 import dequantize_mxfp4

        dtype = torch.bfloat16
        if model is not None and full_layer_name is not None:
            try:
                dtype = model.get_parameter(full_layer_name).dtype
            except AttributeError:
                pass
        resident = dtype == torch.uint8
        parts = []  # (pattern, packed list, scale list)
        for pattern in source_patterns:
            if not pattern.endswith("weight_packed"):
                continue
            packed = input_dict.pop(pattern, None)
            scales = input_dict.pop(pattern.replace("weight_packed", "weight_scale"), None)
            if packed is None or scales is None:
                raise ValueError(f"{full_layer_name}: {pattern} and its weight_scale must both be in the checkpoint")
            packed = packed if isinstance(packed, list) else [packed]
            scales = scales if isinstance(scales, list) else [scales]
            if len(scales) != len(packed):
                raise ValueError(
                    f"{full_layer_name}: {len(packed)} {pattern} tensors but {len(scales)} weight_scale tensors"
                )
            parts.append((pattern, packed, scales))
        if input_dict:
            raise ValueError(f"{full_layer_name}: unexpected tensors beside the MXFP4 experts: {list(input_dict)}")
        experts = {len(packed) for _, packed, _ in parts}
        if len(experts) != 1:
            raise ValueError(
                f"{full_layer_name}: the MXFP4 tensors disagree on the number of experts: {sorted(experts)}"
            )
        E = experts.pop()
        rows = [packed[0].shape[-2] for _, packed, _ in parts]
        cols = {2 * packed[0].shape[-1] for _, packed, _ in parts}
        if len(cols) != 1:
            raise ValueError(f"{full_layer_name}: the MXFP4 tensors disagree on the input width: {sorted(cols)}")
        n_in, device = cols.pop(), parts[0][1][0].device
        if resident:
            out = torch.empty(E, sum(rows), n_in // 2, dtype=torch.uint8, device=device)
            out_scale = torch.empty(E, sum(rows), n_in // MX_BLOCK, dtype=torch.uint8, device=device)
        else:
            out = torch.empty(E, sum(rows), n_in, dtype=dtype, device=device)
        start = 0
        for (pattern, packed, scales), n in zip(parts, rows):
            name = f"{full_layer_name} ({pattern})"
            for e in range(E):
                p, s = mxfp4_bytes(packed[e], scales[e], f"{name}[{e}]", (n, n_in))
                if resident:
                    out[e, start : start + n], out_scale[e, start : start + n] = p, s
                else:
                    out[e, start : start + n] = dequantize_mxfp4(p, s, dtype=dtype, name=f"{name}[{e}]")
                packed[e] = scales[e] = None  # the source bytes go as soon as they are used
            start += n
        if resident:
            return {target_patterns[0]: out, target_patterns[0] + "_scale": out_scale}
        return {target_patterns[0]: out}

    @property
    def reverse_op(self):
        raise NotImplementedError("DequantizeMxfp4 is load-only (save_pretrained of a K3 model re-packs)")


def k3_mapping() -> list:
    """Kimi K3's released layout -> KimiK3ForConditionalGeneration (K3.md-style names on the left):

        language_model.model.*            -> model.language_model.*       language_model.lm_head.* -> lm_head.*
        vision_tower.* / mm_projector.*   -> model.vision_tower.* (renames of moonvit_key_mapping) / model.mm_projector.*
        *.self_attention_res_{norm,proj}  -> *.attn_res.{key_norm.weight, query}  ([1, d] proj -> [d] query)
        *.mlp_res_{norm,proj}             -> *.mlp_res.*;   output_attn_res_* -> final_res.*
        block_sparse_moe.experts.{e}.w1/w3/w2 (.weight_packed + .weight_scale MXFP4, or bf16 .weight)
                                          -> mlp.experts.gate_up_proj [E, 2I, latent] / down_proj [E, latent, I]
        self_attn.A_log [head_dim], zero-padded -> [H]
    plus Kimi Linear's other transforms (block_sparse_moe -> mlp)."""
    vision_root, ours_root = next(p for p in K3_PREFIXES if p[0] == "vision_tower.")
    vision = [
        LoadOnlyRenaming(
            source_patterns="^" + re.escape(vision_root) + src.removeprefix("^"), target_patterns=ours_root + tgt
        )
        for src, tgt in moonvit_key_mapping()
    ]
    res = [
        LoadOnlyRenaming(source_patterns=rf"\.{released}{re.escape(theirs)}$", target_patterns=f".{ours}{mine}")
        for released, ours in K3_RES_NAMES
        for theirs, mine in K3_RES_PARAMS
    ]
    linear = kimi_linear_mapping()
    renames = [t for t in linear if isinstance(t, WeightRenaming)]
    converters = [t for t in linear if not isinstance(t, WeightRenaming)]
    mxfp4 = [  # each expert's weight_packed + weight_scale, decoded into its slice of the stacked parameter
        LoadOnlyConverter(
            source_patterns=[f"mlp.experts.*.{w}.{part}" for w in parts for part in ("weight_packed", "weight_scale")],
            target_patterns=f"mlp.experts.{stacked}",
            operations=[DequantizeMxfp4()],
        )
        for stacked, parts in EXPERT_WEIGHTS.items()
    ]
    query = [
        LoadOnlyConverter(source_patterns=rf"{ours}\.query", target_patterns=f"{ours}.query", operations=[Flatten()])
        for _, ours in K3_RES_NAMES
    ]
    prefixes = [
        LoadOnlyRenaming(source_patterns="^" + re.escape(released), target_patterns=ours)
        for released, ours in K3_PREFIXES
    ]
    return [
        *vision,
        *prefixes,
        *res,
        *renames,
        *query,
        *mxfp4,
        *converters,
    ]


def register_k3() -> None:
    """Registers K3's mapping for its multimodal classes (called by modeling_kimi_k3 at import)."""
    for name in K3_REGISTERED_CLASSES:
        register_checkpoint_conversion_mapping(name, k3_mapping(), overwrite=True)


__all__ = [
    "K3_PREFIXES",
    "K3_REGISTERED_CLASSES",
    "K3_RES_NAMES",
    "K3_RES_PARAMS",
    "DequantizeMxfp4",
    "k3_mapping",
    "mxfp4_bytes",
    "register_k3",
]
