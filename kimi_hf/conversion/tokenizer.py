"""Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json) -> a fast tokenizer (tokenizer.json).

Kimi's repositories ship `tiktoken.model` (one "base64(token) rank" line per token) and
`tokenization_kimi.py` (remote code needing the `tiktoken` package). The fast tokenizer is byte-level
BPE over the same ranks: merges are every (left, right) split of a token whose halves are tokens,
ordered by the merged token's rank, with `ignore_merges` (tiktoken looks a whole piece up before
merging); the pre-tokenizer splits with Kimi's pattern; the 256 ids after the ranks are special
tokens, named by tokenizer_config.json's added_tokens_decoder or `<|reserved_token_{id}|>`.
No `tiktoken` package is needed.
"""

from __future__ import annotations

import base64
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


# TikTokenTokenizer.pat_str of Kimi's tokenization_kimi.py (Han runs apart; case-aware words)
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
RESERVED = 256


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenization emits)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def read_tiktoken(path: str) -> dict[bytes, int]:
    """tiktoken.model -> {token bytes: rank}; malformed lines raise naming the line."""
    ranks = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except Exception:
                raise ValueError(f"{path}:{lineno}: expected 'base64-token rank', got {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0 .. {len(ranks) - 1} without gaps")
    return ranks


def tiktoken_to_fast(
    model_file: str, config_file: str | None = None, pattern: str = KIMI_PATTERN, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    ranks = read_tiktoken(model_file)
    to_char = _byte_to_unicode()
    text = lambda b: "".join(to_char[x] for x in b)  # noqa: E731
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], a, b) for a, b in splits]
    merges.sort()
    bpe = models.BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    config = {}
    if config_file is not None and os.path.exists(config_file):
        with open(config_file) as f:
            config = json.load(f)
    named = {int(k): v["content"] for k, v in (config.get("added_tokens_decoder") or {}).items()}
    n = len(ranks)
    specials = [named.get(i, f"<|reserved_token_{i}|>") for i in range(n, n + RESERVED)]
    kwargs = {
        key: config[key]
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if isinstance(config.get(key), str) and config[key] in specials
    }
    # generation continues each row's right edge: batched pipelines use the saved padding side
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side=config.get("padding_side", "left"), **kwargs)
    fast.add_special_tokens(
        {"additional_special_tokens": [s for s in specials if s not in kwargs.values()]},
        replace_extra_special_tokens=False,
    )
    if fast.convert_tokens_to_ids(specials[0]) != n:
        raise ValueError(f"special tokens did not land at ids {n}.. (got {fast.convert_tokens_to_ids(specials[0])})")
    fast.chat_template = chat_template or config.get("chat_template")
    return fast


def convert_tokenizer_dir(src: str, dst: str) -> bool:
    """Writes tokenizer.json (+ tokenizer_config.json) into dst when src has a tiktoken.model and no
    tokenizer.json. Returns whether it did."""
    model = os.path.join(src, "tiktoken.model")
    if not os.path.exists(model) or os.path.exists(os.path.join(src, "tokenizer.json")):
        return False
    template = None
    if os.path.exists(os.path.join(src, "chat_template.jinja")):
        with open(os.path.join(src, "chat_template.jinja")) as f:
            template = f.read()
    fast = tiktoken_to_fast(model, os.path.join(src, "tokenizer_config.json"), chat_template=template)
    fast.save_pretrained(dst)
    return True


__all__ = ["KIMI_PATTERN", "read_tiktoken", "tiktoken_to_fast", "convert_tokenizer_dir"]
