"""A small byte-level BPE tokenizer with Kimi's chat and media tokens, trained offline.

Kimi's own tokenizer (tiktoken, 163k tokens) cannot be downloaded here; examples, tests and the
quickstart train one on text that ships with Python (the standard library's sources) or on
texts they generate, with the same special tokens and chat markup, so that the processor, the
chat template and the model see what they would with the real one.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .models.kimi_hybrid.chat_markup_kimi_hybrid import (
    BOS,
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    EOS,
    KIMI_MEDIA_TOKENS,
    PAD,
    RESPONSE_TEMPLATE,
    TOOL_TOKENS,
)
from .models.kimi_k3.chat_template_kimi_k3 import use_k3_chat_markup
from .models.kimi_k3.xtml_kimi_k3 import CLOSE, END_OF_MSG, K3_MEDIA_TOKENS, OPEN, SEP


# The trained tokenizers' special tokens, in id order; the strings are the model folders' token tables
# (chat_markup_kimi_hybrid for Kimi's markup, xtml_kimi_k3 for K3's).
SPECIAL_TOKENS = [PAD, BOS, EOS] + CHAT_TOKENS + KIMI_MEDIA_TOKENS + TOOL_TOKENS
# Kimi K3's markup: <|end_of_msg|> and <|open|> special, <|close|> and <|sep|> plain (they decode literally, as in
# K3's tokenizer), the media tokens special
K3_SPECIAL_TOKENS = [PAD, BOS, EOS, END_OF_MSG, OPEN] + K3_MEDIA_TOKENS
K3_PLAIN_TOKENS = [CLOSE, SEP]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024, markup: str = "kimi") -> PreTrainedTokenizerFast:
    """Byte-level BPE over `texts` with the special tokens of `markup` first and its chat template:
    "kimi" (Kimi K2 / Kimi Linear): SPECIAL_TOKENS (ids 0..16, in that order); "k3": K3_SPECIAL_TOKENS (ids
    0..8), then `<|close|>` / `<|sep|>` as plain added tokens after the BPE vocabulary, K3's chat and response
    templates."""
    if markup not in ("kimi", "k3"):
        raise ValueError(f"markup must be 'kimi' or 'k3', got {markup!r}")
    specials = SPECIAL_TOKENS if markup == "kimi" else K3_SPECIAL_TOKENS
    if not isinstance(vocab_size, int) or vocab_size < 256 + len(specials):
        raise ValueError(
            f"vocab_size must be an integer >= {256 + len(specials)} (bytes + special tokens), got {vocab_size!r}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if markup == "k3":
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in K3_PLAIN_TOKENS])
    # pads on the left: generation continues each row's right edge (pipelines batch with the saved side)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=specials[3:],
        padding_side="left",
    )
    if markup == "k3":
        return use_k3_chat_markup(fast)
    fast.chat_template = CHAT_TEMPLATE
    fast.response_template = RESPONSE_TEMPLATE
    return fast


__all__ = [
    "train_tokenizer",
    "SPECIAL_TOKENS",
    "K3_SPECIAL_TOKENS",
    "K3_PLAIN_TOKENS",
    "TOOL_TOKENS",
    "BOS",
    "EOS",
    "PAD",
]
