"""Batched chat replies from a model of this package (or any transformers chat model + processor)."""

from __future__ import annotations

import torch

from .models.kimi_hybrid.chat_markup_kimi_hybrid import IMAGE_TOKEN, TURN_END, chat_stop_token_ids


@torch.no_grad()
def generate_replies(
    model, processor, conversations: list[list[dict]], images=None, max_new_tokens: int = 32, **generate_kwargs
) -> list[str]:
    """One reply per conversation (a list of chat messages; image parts take `images` in order), in one
    left-padded batch; greedy unless generate_kwargs say otherwise. Returns the stripped reply texts."""
    prompts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues the right edge
    try:
        inputs = processor(
            images=list(images) if images else None, text=prompts, padding=True, return_tensors="pt"
        ).to(model.device)
    finally:
        tokenizer.padding_side = side
    out = model.generate(**inputs, **{"max_new_tokens": max_new_tokens, "do_sample": False, **generate_kwargs})
    return [
        r.strip() for r in processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    ]


__all__ = ["generate_replies", "chat_stop_token_ids", "TURN_END", "IMAGE_TOKEN"]
