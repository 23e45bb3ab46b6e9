"""Data collators for fine-tuning the multimodal model with transformers' Trainer / TRL."""

from __future__ import annotations

import torch

from .models.kimi_hybrid.chat_markup_kimi_hybrid import ASSISTANT, MIDDLE, TURN_END
from .models.kimi_k3.chat_template_kimi_k3 import has_k3_markup
from .models.kimi_k3.xtml_kimi_k3 import END_OF_MSG, OPEN, SEP


IGNORE_INDEX = -100


class KimiHybridVisionCollator:
    """Chat examples with images -> a padded batch with labels.

    Each example is {"messages": [...], "images": [...]} (TRL's vision format; image parts of the
    messages are {"type": "image"} and the images come in order from "images"). Labels are the input
    ids with IGNORE_INDEX on padding and image placeholders, and, with train_on="assistant" (default),
    on every token outside the assistant replies (the reply's closing <|im_end|> is kept so that the
    model learns to stop); train_on="all" keeps all text tokens. A processor with Kimi K3's markup (XTML):
    the replies are what follows each `<|open|>message role="assistant"<|sep|>` header, through its
    `<|end_of_msg|>`. `chat_template_kwargs` go to every apply_chat_template (e.g. K3's
    thinking_effort=None).
    """

    def __init__(self, processor, train_on: str = "assistant", chat_template_kwargs: dict | None = None):
        if train_on not in ("assistant", "all"):
            raise ValueError(f"train_on must be 'assistant' or 'all', got {train_on!r}")
        self.processor, self.train_on = processor, train_on
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        tok = processor.tokenizer
        self.k3 = has_k3_markup(tok)
        names = (OPEN, SEP, END_OF_MSG) if self.k3 else (ASSISTANT, MIDDLE, TURN_END)
        self.ids = {name: tok.convert_tokens_to_ids(name) for name in names}

    def _last(self, ids: torch.Tensor, token: str, strictly_before: bool) -> torch.Tensor:
        """[B, T]: position of the last `token` at (or strictly before) each position, -1 if none."""
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        last = torch.where(ids == self.ids[token], pos, -1).cummax(1).values
        if strictly_before:
            last = torch.cat([last.new_full((ids.shape[0], 1), -1), last[:, :-1]], 1)
        return last

    def _k3_assistant_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: K3's replies as the model writes them (the template's {% generation %} span): after an
        assistant message's header (`<|open|>message role="assistant" ...<|sep|>`, the header text between the two
        tokens decoded) and the channel the generation prompt opens with it (`<|open|>think<|sep|>`, or
        `<|open|>response<|sep|>` with thinking off), through the message's `<|end_of_msg|>`. Only the markup
        tokens are visited, not every token."""
        tok, open_id, sep_id, end_id = self.processor.tokenizer, *(self.ids[t] for t in (OPEN, SEP, END_OF_MSG))
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for b, row in enumerate(ids):
            markup = torch.nonzero((row == open_id) | (row == sep_id) | (row == end_id)).flatten().tolist()
            kinds = row[markup].tolist()
            reply_until = -1  # inside a reply (its own think / response elements) up to this position
            for j, (pos, kind) in enumerate(zip(markup, kinds)):
                if kind != open_id or pos <= reply_until or j + 1 == len(markup) or kinds[j + 1] != sep_id:
                    continue
                sep = markup[j + 1]
                if tok.decode(row[pos + 1 : sep]).split()[:2] != ["message", 'role="assistant"']:
                    continue
                start = sep + 1
                if kinds[j + 2 : j + 4] == [open_id, sep_id] and markup[j + 2] == start:  # the opened channel
                    start = markup[j + 3] + 1
                end = next((p for p, k in zip(markup[j + 2 :], kinds[j + 2 :]) if k == end_id), len(row) - 1)
                mask[b, start : end + 1] = True
                reply_until = end
        return mask

    def _assistant_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: the tokens of assistant replies, from the first <|im_middle|> after an
        <|im_assistant|> up to and including the next <|im_end|> (vectorised over tokens)."""
        if self.k3:
            return self._k3_assistant_mask(ids)
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
            texts.append(
                self.processor.apply_chat_template(ex["messages"], tokenize=False, **self.chat_template_kwargs)
            )
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
