"""Tiny configs shared by the model tests."""

import functools

import torch

from kimi_hf import KimiHybridTextConfig


TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    linear_num_heads=2,
    linear_head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
)


def tiny_config(**overrides) -> KimiHybridTextConfig:
    return KimiHybridTextConfig(**{**TINY, **overrides})


def train_losses(model, opt, batches) -> list[float]:
    """A plain training loop (the tests' one): a causal-LM step per batch of input ids (labels = inputs, no
    cache), the losses as floats."""
    losses = []
    for x in batches:
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


TINY_VISION = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, pos_emb_height=8, pos_emb_width=8
)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
    """A 600-token byte-level BPE with Kimi's chat/media tokens, trained on a few stdlib sources."""
    from kimi_hf.data import stdlib_source_files
    from kimi_hf.tokenization import train_tokenizer

    return train_tokenizer([open(p, encoding="utf-8").read() for p in stdlib_source_files()[:20]], vocab_size=600)


def tiny_processor():
    from kimi_hf import KimiHybridImageProcessor, KimiHybridProcessor

    return KimiHybridProcessor(KimiHybridImageProcessor(), tiny_tokenizer())


def tiny_multimodal_config(**text_overrides):
    from kimi_hf import KimiHybridConfig
    from kimi_hf.chat import chat_stop_token_ids

    tok = tiny_tokenizer()
    text = {
        **TINY,
        "vocab_size": len(tok),
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": chat_stop_token_ids(tok),
        **text_overrides,
    }
    return KimiHybridConfig(
        text_config=text, vision_config=TINY_VISION, image_token_id=tok.convert_tokens_to_ids("<|media_pad|>")
    )
