"""Batched chat replies from a model of this package (or any transformers chat model + processor), and the choice
between Kimi's chat markup and Kimi K3's for code that takes either kind of tokenizer.

The model folders each know their own markup only (kimi_hybrid's chat_markup_kimi_hybrid.py: Kimi K2 / K2.5 /
Kimi Linear; kimi_k3's chat_template_kimi_k3.py: K3's XTML), so that a Kimi Linear Hub folder ships no K3 code;
`has_k3_markup` picks here.
"""

from __future__ import annotations

import torch
from transformers.generation.streamers import BaseStreamer

from .models.kimi_hybrid.chat_markup_kimi_hybrid import IMAGE_TOKEN, TURN_END, kimi_stop_token_ids
from .models.kimi_k3.chat_template_kimi_k3 import has_k3_markup, k3_stop_token_ids
from .models.kimi_k3.reply_parser_kimi_k3 import parse_k3_reply


def chat_stop_token_ids(tokenizer) -> list[int]:
    """The ids that chat generation stops on, by the tokenizer's markup: with Kimi K3's, `k3_stop_token_ids`
    (<|end_of_msg|> first, then EOS); else `kimi_stop_token_ids` (EOS and, where the tokenizer has it, <|im_end|>:
    the chat template closes every reply with it, so a model trained on chats writes it, not EOS, when its reply
    is done). Use it as the model config's `eos_token_id`."""
    return k3_stop_token_ids(tokenizer) if has_k3_markup(tokenizer) else kimi_stop_token_ids(tokenizer)


@torch.no_grad()
def generate_replies(
    model,
    processor,
    conversations: list[list[dict]],
    images=None,
    max_new_tokens: int = 32,
    chat_template_kwargs: dict | None = None,
    **generate_kwargs,
) -> list[str]:
    """One reply per conversation (a list of chat messages; image parts take `images` in order), in one
    left-padded batch; greedy unless generate_kwargs say otherwise. Returns the stripped reply texts (with
    Kimi K3's markup: the response channel's text, read by parse_k3_reply). `chat_template_kwargs` go to
    apply_chat_template (e.g. K3's thinking_effort)."""
    options = dict(chat_template_kwargs or {})
    prompts = [
        processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **options) for c in conversations
    ]
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # generation continues the right edge
    try:
        inputs = processor(
            images=list(images) if images else None, text=prompts, padding=True, return_tensors="pt"
        ).to(model.device)
    finally:
        tokenizer.padding_side = side
    out = model.generate(**inputs, **{"max_new_tokens": max_new_tokens, "do_sample": False, **generate_kwargs})
    new = out[:, inputs["input_ids"].shape[1] :]
    return [reply_text(tokenizer, ids, prompt) for ids, prompt in zip(new, prompts)]


def reply_text(tokenizer, new_ids, prompt: str = "") -> str:
    """The stripped reply text of generated ids `new_ids` [T] after `prompt`: with Kimi K3's markup (XTML) the
    response channel's text (parse_k3_reply, lenient), else the decoded text without special tokens."""
    if has_k3_markup(tokenizer):  # K3's XTML: the markup is in the text; the reply is a channel
        text = tokenizer.decode(new_ids, skip_special_tokens=False)
        return (parse_k3_reply(text, prefix=prompt, strict=False)["content"] or "").strip()
    return tokenizer.decode(new_ids, skip_special_tokens=True).strip()


class K3ReplyStreamer(BaseStreamer):
    """A `generate(streamer=...)` streamer for Kimi K3 replies: prints the response channel as it grows (the
    think channel and the markup are not printed). `prefix`: the prompt (where the generation prompt left
    off). Text from a `<|` onwards is held back until the markup it may start is known."""

    def __init__(self, tokenizer, prefix: str = ""):
        self.tokenizer, self.prefix = tokenizer, prefix
        self.ids: list[int] = []
        self.shown, self.prompt_seen = "", False

    def put(self, value):
        if not self.prompt_seen:  # generate puts the prompt first
            self.prompt_seen = True
            return
        self.ids += value.flatten().tolist()
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        content = parse_k3_reply(text, prefix=self.prefix, strict=False)["content"] or ""
        content = content.split("<|")[0]
        if content.startswith(self.shown) and len(content) > len(self.shown):
            print(content[len(self.shown) :], end="", flush=True)
            self.shown = content

    def end(self):
        print(flush=True)
        self.ids, self.shown, self.prompt_seen = [], "", False


__all__ = [
    "generate_replies",
    "reply_text",
    "has_k3_markup",
    "K3ReplyStreamer",
    "chat_stop_token_ids",
    "TURN_END",
    "IMAGE_TOKEN",
]
