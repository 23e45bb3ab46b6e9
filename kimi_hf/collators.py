"""Data collators for fine-tuning the multimodal model with transformers' Trainer / TRL."""

from __future__ import annotations

import torch

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
        self.ids = {name: tok.convert_tokens_to_ids(name) for name in ("<|im_assistant|>", "<|im_middle|>", "<|im_end|>")}

    def _assistant_mask(self, row: list[int]) -> list[bool]:
        keep, header, inside = [], False, False
        for t in row:
            if inside:
                keep.append(True)
                inside = t != self.ids["<|im_end|>"]
                continue
            keep.append(False)
            if t == self.ids["<|im_assistant|>"]:
                header = True
            elif header and t == self.ids["<|im_middle|>"]:
                header, inside = False, True
        return keep

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
            keep = torch.tensor([self._assistant_mask(row) for row in ids.tolist()], dtype=torch.bool)
            labels = labels.masked_fill(~keep, IGNORE_INDEX)
        batch["labels"] = labels
        return batch


__all__ = ["KimiHybridVisionCollator", "IGNORE_INDEX"]
