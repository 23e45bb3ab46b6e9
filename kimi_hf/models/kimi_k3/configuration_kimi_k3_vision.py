"""Configuration of Kimi K3's vision tower (MoonViT3d: the K2.5 code with K3's config switches) and its
patchmergerv2 projector: `KimiK3VisionConfig` reads and writes K3's released `vision_config` spelling."""

import dataclasses
import re

from huggingface_hub.dataclasses import strict

from ..kimi_hybrid.configuration_kimi_hybrid_vision import (
    _GENERIC_FIELDS,
    EXTRA_ATTRIBUTES_KEY,
    MOONSHOT_FIXED_FIELDS,
    MOONSHOT_RENAMED_FIELDS,
    KimiHybridVisionConfig,
    extra_attributes,
    with_extra_attributes,
)


# The released field order (Kimi K3's config.json), which to_dict() follows.
K3_RELEASED_ORDER = (
    "patch_size",
    "init_pos_emb_height",
    "init_pos_emb_width",
    "init_pos_emb_time",
    "pos_emb_type",
    "pos_emb_interpolation_mode",
    "vt_hidden_size",
    "vt_num_hidden_layers",
    "vt_num_attention_heads",
    "qkv_hidden_size",
    "vt_intermediate_size",
    "norm_type",
    "attn_bias",
    "linear_bias",
    "patch_embed_proj_bias",
    "mlp_type",
    "activation_func",
    "merge_kernel_size",
    "merge_type",
    "mm_projector_type",
    "mm_hidden_size",
    "projector_hidden_act",
    "projector_ln_eps",
    "text_hidden_size",
)


@strict
class KimiK3VisionConfig(KimiHybridVisionConfig):
    r"""
    Kimi K3's vision tower (MoonViT3d: the K2.5 code with K3's config switches) and patchmergerv2 projector, read
    from the RELEASED `vision_config` spelling and written back in it (`to_dict`). Defaults: the released values.

    Released field -> this config (KimiHybridVisionConfig's field):
        patch_size, qkv_hidden_size, norm_type, pos_emb_interpolation_mode, merge_kernel_size: the same name;
        init_pos_emb_height / _width / _time -> pos_emb_height / _width / _time;
        vt_hidden_size, vt_num_hidden_layers, vt_num_attention_heads, vt_intermediate_size -> hidden_size,
            num_hidden_layers, num_attention_heads, intermediate_size (these names are accepted too);
        attn_bias -> attention_bias, linear_bias -> mlp_bias, patch_embed_proj_bias -> patch_embed_bias;
        activation_func -> hidden_act (must be "gelu_pytorch_tanh": the official code hard-codes tanh GELU);
        mm_projector_type -> projector_type; projector_ln_eps -> projector_layer_norm_eps;
        mm_hidden_size: must be None or vt_hidden_size (the projector reads the tower's output);
        text_hidden_size: the projector's output width (kept as is; the multimodal model checks it);
        pos_emb_type "divided_fixed", mlp_type "mlp2", merge_type "sd2_tpool", projector_hidden_act "gelu" (and
            K2.5's video_attn_type "spatial_temporal"): the only values implemented, anything else raises;
        _attn_implementation: ignored (see KimiHybridVisionConfig).
    rope_parameters is fixed to {"rope_type": "interleaved_2d", "rope_theta": 10000.0} (K3's layout) and not
    written. A field this tower does not implement raises a ValueError naming it. Moonshot's Kimi K2.5
    vision_config (same spelling, without the norm / bias / qkv keys) is not read by this class: missing keys
    take K3's values.
    """

    model_type = "kimi_k3_vision"
    default_rope_type = "interleaved_2d"

    hidden_size: int = 1024
    num_attention_heads: int = 12
    intermediate_size: int = 4096
    norm_type: str = "rmsnorm"
    attention_bias: bool = False
    mlp_bias: bool = False
    patch_embed_bias: bool = False
    qkv_hidden_size: int | None = 1536
    pos_emb_interpolation_mode: str = "bilinear"
    projector_type: str = "patchmergerv2"
    projector_layer_norm_eps: float | None = 1e-5
    text_hidden_size: int | None = 7168

    def __post_init__(self, **kwargs):
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for released, ours in MOONSHOT_RENAMED_FIELDS.items():
            if released not in kwargs:
                continue
            value, current = kwargs.pop(released), getattr(self, ours)
            if current != defaults[ours] and current != value:
                raise ValueError(f"{released} = {value!r} and {ours} = {current!r}: one field, two values")
            try:
                setattr(self, ours, value)
            except Exception as err:  # strict type validation names our field; name the released one
                raise ValueError(f"{released} = {value!r}: {err}") from err
        for name, allowed in MOONSHOT_FIXED_FIELDS.items():
            if name in kwargs and (value := kwargs.pop(name)) not in allowed:
                raise ValueError(f"{name} = {value!r} is not supported (this tower implements {list(allowed)})")
        mm_hidden = kwargs.pop("mm_hidden_size", None)
        if mm_hidden is not None and mm_hidden != self.hidden_size:
            raise ValueError(
                f"mm_hidden_size = {mm_hidden!r} must equal vt_hidden_size ({self.hidden_size}): the projector "
                "reads the tower's output"
            )
        kwargs.pop("_attn_implementation", None)
        ours = set(kwargs.pop(EXTRA_ATTRIBUTES_KEY, ()))  # extra attributes our own to_dict wrote
        unknown = sorted(k for k in kwargs if k not in _GENERIC_FIELDS | ours and not k.startswith("_"))
        if unknown:
            raise ValueError(f"vision_config fields this tower does not implement: {unknown}")
        super().__post_init__(**kwargs)

    def _validate(self):
        try:
            super()._validate()
        except ValueError as err:  # name the field as the release spells it
            message = str(err)
            for released, ours in MOONSHOT_RENAMED_FIELDS.items():
                message = re.sub(rf"\b{ours}\b", f"{released} ({ours})", message)
            raise ValueError(message) from None
        if self.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(
                f"activation_func = {self.hidden_act!r} is not supported: Kimi K3's tower hard-codes tanh GELU "
                "('gelu_pytorch_tanh')"
            )
        rope = self.rope_parameters
        if rope.get("rope_type", self.default_rope_type) != "interleaved_2d" or rope.get("rope_theta", 1e4) != 1e4:
            raise ValueError(
                f"rope_parameters = {rope!r}: Kimi K3's tower uses {{'rope_type': 'interleaved_2d', "
                "'rope_theta': 10000.0}}"
            )
        if self.text_hidden_size is not None and (
            not isinstance(self.text_hidden_size, int) or self.text_hidden_size < 1
        ):
            raise ValueError(f"text_hidden_size must be None or a positive integer, got {self.text_hidden_size!r}")

    def to_dict(self) -> dict:
        """The released spelling (K3_RELEASED_ORDER first), then the generic keys; rope_parameters (fixed) is
        left out, and so are rms_norm_eps / layer_norm_eps / initializer_range while they have K3's defaults."""
        out = super().to_dict()
        for released, ours in MOONSHOT_RENAMED_FIELDS.items():
            out[released] = out.pop(ours)
        out.update(
            pos_emb_type="divided_fixed",
            mlp_type="mlp2",
            merge_type="sd2_tpool",
            mm_hidden_size=self.hidden_size,
            projector_hidden_act="gelu",
        )
        out.pop("rope_parameters", None)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in ("rms_norm_eps", "layer_norm_eps", "initializer_range"):
            if out.get(name) == defaults[name]:
                out.pop(name)
        ordered = {k: out.pop(k) for k in K3_RELEASED_ORDER}
        extras = extra_attributes(self)
        ordered.update((k, v) for k, v in out.items() if k not in extras)
        return with_extra_attributes(self, ordered)


__all__ = ["K3_RELEASED_ORDER", "KimiK3VisionConfig"]
