"""Model presets: the small Kimi K3 and Kimi Linear (hybrid) models that `kimi-hf quickstart` trains and the
examples, benchmarks and tests build.

    SIZES                    the quickstart's sizes (tiny, small, base): hidden, layers, experts, vision, vocabulary
    small_multimodal_model   a KimiHybridForConditionalGeneration of one of SIZES (Kimi Linear's layout)
    small_k3_model           a KimiK3ForConditionalGeneration of one of SIZES (Kimi K3's architecture)
    small_k3_config          a small KimiK3Config in the released config's field names

Importing this module imports neither torch nor transformers (`kimi-hf quickstart --help` reads SIZES).
"""

from __future__ import annotations


SIZES = {  # hidden, layers (3 KDA : 1 MLA), experts, vision hidden, vocabulary
    "tiny": dict(hidden=64, layers=4, experts=4, vision_hidden=32, vocab=512),
    "small": dict(hidden=128, layers=4, experts=4, vision_hidden=64, vocab=1024),
    "base": dict(hidden=256, layers=8, experts=8, vision_hidden=128, vocab=2048),
}


def small_multimodal_model(tokenizer, size: str = "small", image_size: int = 84, attn_residual: str = "none"):
    """A KimiHybridForConditionalGeneration of one of SIZES for `tokenizer` (Kimi Linear's 3:1
    KDA:MLA layout and a dense first layer, then MoE; MoonViT tower with positions for image_size)."""
    from . import KimiHybridConfig, KimiHybridForConditionalGeneration
    from .chat import IMAGE_TOKEN, chat_stop_token_ids

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    s, side = SIZES[size], image_size // 14 + 1
    h = s["hidden"]
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=h,
        intermediate_size=2 * h,
        moe_intermediate_size=h // 2,
        num_hidden_layers=s["layers"],
        first_k_dense_replace=1,
        num_attention_heads=2,
        kv_lora_rank=h // 4,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_experts=s["experts"],
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_num_heads=2,
        linear_head_dim=h // 2,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=chat_stop_token_ids(tokenizer),
        attn_residual=attn_residual,
    )  # replies stop at the turn end
    vision = dict(
        hidden_size=s["vision_hidden"],
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * s["vision_hidden"],
        pos_emb_height=side,
        pos_emb_width=side,
    )
    config = KimiHybridConfig(
        text_config=text, vision_config=vision, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    )
    return KimiHybridForConditionalGeneration(config)


def small_k3_model(tokenizer, size: str = "small", image_size: int = 84):
    """A KimiK3ForConditionalGeneration of one of SIZES for a K3-markup `tokenizer` (train_tokenizer(...,
    markup="k3")): the K3 architecture of `small_k3_config` (safe-gate KDA 3 : 1 gated MLA, SiTU LatentMoE,
    K3 Block AttnRes, the K3 MoonViT3d tower, two blocks) at that size; eos <|end_of_msg|>."""
    from . import KimiK3ForConditionalGeneration
    from .models.kimi_k3.xtml_kimi_k3 import K3_STOP_TOKEN, MEDIA_PAD

    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    s = SIZES[size]
    config = small_k3_config(
        hidden=s["hidden"],
        layers=s["layers"],
        vocab_size=len(tokenizer),
        experts=s["experts"],
        vision_hidden=s["vision_hidden"],
        vision_layers=2,
        vision_pos_emb=image_size // 14 + 1,
        media_token_id=tokenizer.convert_tokens_to_ids(MEDIA_PAD),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(K3_STOP_TOKEN),
        pad_token_id=tokenizer.pad_token_id,
    )
    return KimiK3ForConditionalGeneration(config)


def small_k3_config(
    hidden: int = 96,
    layers: int = 6,
    *,
    vocab_size: int = 259,
    heads: int = 2,
    mla_head_dim: int = 16,
    experts: int = 8,
    top_k: int = 2,
    attn_res_block_size: int = 2,
    k3_parts: bool = True,
    vision_hidden: int = 32,
    vision_layers: int = 1,
    vision_pos_emb: int = 8,
    media_token_id: int = 258,
    bos_token_id: int = 256,
    eos_token_id: int = 257,
    pad_token_id: int = 258,
):
    """A small Kimi K3-architecture KimiK3Config, in the released config's field names: K3's layer pattern
    (kimi_linear_layer_types, Kimi Linear's 3 : 1 rule: KDA at 1-based layers not divisible by 4, MLA there and
    last), a dense layer 0, the safe gate and full-rank KDA output gate, gated MLA with q LoRA (nope = v =
    mla_head_dim, rope = half), SiTU, Stable LatentMoE (latent hidden / 2, one shared expert) and Block AttnRes
    every attn_res_block_size layers, a MoonViT3d tower of vision_layers blocks. k3_parts=False turns Attention
    Residuals and LatentMoE off (experts at the full width), the rest unchanged: the comparison benchmarks/k3.py
    makes."""
    from . import KimiK3Config
    from .models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types

    layer_types = kimi_linear_layer_types(layers)  # 1-based below, as the released config writes them
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        q_lora_rank=hidden // 2,
        kv_lora_rank=hidden // 2,
        qk_nope_head_dim=mla_head_dim,
        qk_rope_head_dim=mla_head_dim // 2,
        v_head_dim=mla_head_dim,
        num_experts=experts,
        num_experts_per_token=top_k,
        num_shared_experts=1,
        linear_attn_config=dict(
            num_heads=heads,
            head_dim=hidden // heads,
            short_conv_kernel_size=4,
            use_full_rank_gate=True,
            gate_lower_bound=-5.0,
            kda_layers=[i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
            full_attn_layers=[i + 1 for i, t in enumerate(layer_types) if t == "full_attention"],
        ),
        first_k_dense_replace=1,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if k3_parts:
        text.update(attn_res_block_size=attn_res_block_size, routed_expert_hidden_size=hidden // 2)
        text.update(latent_moe_use_norm=True)
    else:
        text.update(attn_residual="none", routed_expert_hidden_size=None, latent_moe_use_norm=False)
    vision = dict(
        vt_hidden_size=vision_hidden,
        vt_num_hidden_layers=vision_layers,
        vt_num_attention_heads=2,
        qkv_hidden_size=vision_hidden,
        vt_intermediate_size=2 * vision_hidden,
        init_pos_emb_height=vision_pos_emb,
        init_pos_emb_width=vision_pos_emb,
        text_hidden_size=hidden,
    )
    return KimiK3Config(
        text_config=text,
        vision_config=vision,
        media_placeholder_token_id=media_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


__all__ = ["SIZES", "small_multimodal_model", "small_k3_model", "small_k3_config"]
