"""Data collators for fine-tuning the multimodal model with transformers' Trainer / TRL."""

from __future__ import annotations

import torch

from .models.kimi_hybrid.chat_markup_kimi_hybrid import ASSISTANT, MIDDLE, TURN_END


IGNORE_INDEX = -100


class KimiHybridVisionCollator:
    """Chat examples with images -> a padded batch with labels.

    Each example is {"messages": [...], "images": [...]} (TRL's vision format; image parts of the
    messages are {"type": "image"} and the images come in order from "images"). Labels are the input
    ids with IGNORE_INDEX on padding and image placeholders, and, with train_on="assistant" (default),
    on every token outside the assistant replies (the reply's closing <|im_end|> is kept so that the
    model learns to stop); train_on="all" keeps all text tokens.
    """

    def __init__(self, processor, train_on: str = "assistant"):
        if train_on not in ("assistant", "all"):
            raise ValueError(f"train_on must be 'assistant' or 'all', got {train_on!r}")
        self.processor, self.train_on = processor, train_on
        tok = processor.tokenizer
        self.ids = {name: tok.convert_tokens_to_ids(name) for name in (ASSISTANT, MIDDLE, TURN_END)}

    def _last(self, ids: torch.Tensor, token: str, strictly_before: bool) -> torch.Tensor:
        """[B, T]: position of the last `token` at (or strictly before) each position, -1 if none."""
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        last = torch.where(ids == self.ids[token], pos, -1).cummax(1).values
        if strictly_before:
            last = torch.cat([last.new_full((ids.shape[0], 1), -1), last[:, :-1]], 1)
        return last

    def _assistant_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: the tokens of assistant replies, from the first <|im_middle|> after an
        <|im_assistant|> up to and including the next <|im_end|> (vectorised over tokens)."""
        header = self._last(ids, ASSISTANT, False)
        middle = self._last(ids, MIDDLE, True)
        end = self._last(ids, TURN_END, True)  # strictly before: a reply keeps its own <|im_end|>
        return (header >= 0) & (middle > header) & (end < middle)

    def __call__(self, examples: list[dict]) -> dict:
        if not examples:
            raise ValueError("examples is empty")
        texts, images = [], []
        for i, ex in enumerate(examples):
            if "messages" not in ex:
                raise ValueError(f"examples[{i}] has no 'messages'")
            texts.append(self.processor.apply_chat_template(ex["messages"], tokenize=False))
            images += list(ex.get("images") or [])
        batch = self.processor(images=images or None, text=texts, padding=True, return_tensors="pt")
        ids = batch["input_ids"]
        labels = ids.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        labels = labels.masked_fill(ids == self.processor.image_token_id, IGNORE_INDEX)
        if self.train_on == "assistant":
            labels = labels.masked_fill(~self._assistant_mask(ids), IGNORE_INDEX)
        batch["labels"] = labels
        return batch


__all__ = ["KimiHybridVisionCollator", "IGNORE_INDEX"]
