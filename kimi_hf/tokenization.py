"""A small byte-level BPE tokenizer with Kimi's chat and media tokens, trained offline.

Kimi's own tokenizer (tiktoken, 163k tokens) cannot be downloaded here; examples, tests and the
quickstart train one on text that ships with Python (the standard library's sources) or on
texts they generate, with the same special tokens and chat markup, so that the processor, the
chat template and the model see what they would with the real one.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .models.kimi_hybrid.chat_markup_kimi_hybrid import (
    CHAT_TEMPLATE,
    CHAT_TOKENS,
    MEDIA_TOKENS,
    RESPONSE_TEMPLATE,
    TOOL_TOKENS,
)


BOS, EOS, PAD = "[BOS]", "[EOS]", "[PAD]"
SPECIAL_TOKENS = [PAD, BOS, EOS] + CHAT_TOKENS + MEDIA_TOKENS + TOOL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Byte-level BPE over `texts` with SPECIAL_TOKENS (ids 0..16, in that order) and the chat template."""
    if not isinstance(vocab_size, int) or vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be an integer >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {vocab_size!r}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # pads on the left: generation continues each row's right edge (pipelines batch with the saved side)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=CHAT_TOKENS + MEDIA_TOKENS + TOOL_TOKENS,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.response_template = RESPONSE_TEMPLATE
    return fast


__all__ = ["train_tokenizer", "SPECIAL_TOKENS", "TOOL_TOKENS", "BOS", "EOS", "PAD"]
