"""Tiny configs shared by the model tests."""

import torch

from kimi_hf import KimiHybridTextConfig

TINY = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    num_experts=4, num_experts_per_tok=2, n_shared_experts=1, linear_num_heads=2, linear_head_dim=8,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
)


def tiny_config(**overrides) -> KimiHybridTextConfig:
    return KimiHybridTextConfig(**{**TINY, **overrides})


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
