"""Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json) -> a fast tokenizer, in memory.

Kimi's repositories (K3's release, and K2 / K2.5 / Kimi Linear alike) ship `tiktoken.model` (one "base64(token)
rank" line per token) and `tokenization_kimi.py` (remote code needing the `tiktoken` package). The fast tokenizer
is byte-level BPE over the same ranks: merges are every (left, right) split of a token whose halves are tokens,
ordered by the merged token's rank, with `ignore_merges` (tiktoken looks a whole piece up before merging); the
pre-tokenizer splits with Kimi's pattern; the 256 ids after the ranks are added tokens, named by
tokenizer_config.json's added_tokens_decoder or `<|reserved_token_{id}|>`, special unless the config marks them
`"special": false` (a K3 config's unmarked ones take K3_TOKEN_OFFSETS' flags). No `tiktoken` package is needed.

KimiK3Processor reads a released K3 folder with it; kimi_hf.conversion.tokenizer writes the converted folder
(tokenizer.json) from it. Part of the flat, Hub-copyable model folder: imports only the standard library,
tokenizers, transformers, the token tables (xtml_kimi_k3.py, chat_markup_kimi_hybrid.py) and K3's chat template.
"""

from __future__ import annotations

import base64
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..kimi_hybrid.chat_markup_kimi_hybrid import BOS, EOS, PAD, TURN_END, UNK
from .chat_template_kimi_k3 import use_k3_chat_markup
from .xtml_kimi_k3 import END_OF_MSG, K3_TOKEN_OFFSETS, OPEN


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
RESERVED = 256  # the added tokens: the ids after the BPE ranks (K3_TOKEN_OFFSETS are offsets into them)
# the roles K3's tokenizer_config.json gives its tokens, used where a K3 config leaves one out
K3_ROLES = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}


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


def token_content(value) -> str | None:
    """A tokenizer_config.json token entry: a string or an AddedToken-like {"content": ...} dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def tokenizer_family(source) -> str | None:
    """Which Kimi tokenizer this is, from its added tokens' names: "k3" (`<|end_of_msg|>`, `<|open|>`),
    "k2" (K2 / K2.5 / Kimi-Linear: `<|im_end|>`) or None. `source`: a tokenizer_config.json dict (its
    added_tokens_decoder), a path to one, or a tokenizer (its added_tokens_decoder)."""
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            source = json.load(f)
    if isinstance(source, dict):
        names = {token_content(v) for v in (source.get("added_tokens_decoder") or {}).values()}
    else:
        names = {t.content for t in source.added_tokens_decoder.values()}
    if END_OF_MSG in names and OPEN in names:
        return "k3"
    if TURN_END in names:
        return "k2"
    return None


def special_token_table(config: dict, n_ranks: int) -> list[AddedToken]:
    """The RESERVED added tokens at ids n_ranks .. n_ranks + 255, in id order: named and flagged by the
    config's added_tokens_decoder (`special` defaults to true, or to K3_TOKEN_OFFSETS' flag for a K3
    name), else `<|reserved_token_{id}|>` (special). Matched whole, never normalised or stripped unless
    the config says so."""
    decoder = {int(k): v for k, v in (config.get("added_tokens_decoder") or {}).items()}
    outside = sorted(i for i in decoder if not n_ranks <= i < n_ranks + RESERVED)
    if outside:
        raise ValueError(
            f"added_tokens_decoder ids {outside[:5]} lie outside the {RESERVED} ids after the {n_ranks} ranks"
        )
    k3_flags = dict(K3_TOKEN_OFFSETS.values()) if tokenizer_family(config) == "k3" else {}
    table = []
    for i in range(n_ranks, n_ranks + RESERVED):
        entry = decoder.get(i, {})
        entry = {"content": entry} if isinstance(entry, str) else entry
        content = entry.get("content") or f"<|reserved_token_{i}|>"
        special = entry.get("special", k3_flags.get(content, True))
        table.append(
            AddedToken(
                content,
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", False)),
                special=bool(special),
            )
        )
    return table


def tiktoken_to_fast(
    model_file: str, config_file: str | None = None, pattern: str = KIMI_PATTERN, chat_template: str | None = None
) -> PreTrainedTokenizerFast:
    """tiktoken.model (+ tokenizer_config.json) -> a fast tokenizer of len(ranks) + 256 ids: the ranks'
    byte-level BPE, then the added tokens of `special_token_table` (special ones skipped by
    `skip_special_tokens`, the others, K3's `<|close|>` / `<|sep|>`, kept), bos / eos / pad / unk from the
    config (a K3 config's missing ones from K3_ROLES)."""
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
    n = len(ranks)
    table = special_token_table(config, n)
    # one call, in id order: the added tokens take ids n, n + 1, ... and keep their own `special` flag
    # (the flag is what the Rust decoder's skip_special_tokens consults)
    tok.add_tokens(table)
    specials = {t.content for t in table if t.special}
    roles = {key: token_content(config.get(key)) for key in K3_ROLES}
    if tokenizer_family(config) == "k3":
        roles = {key: name or K3_ROLES[key] for key, name in roles.items()}
    kwargs = {key: name for key, name in roles.items() if name in specials}
    # generation continues each row's right edge: batched pipelines use the saved padding side
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        padding_side=config.get("padding_side", "left"),
        extra_special_tokens=[t.content for t in table if t.special and t.content not in kwargs.values()],
        **kwargs,
    )
    if fast.convert_tokens_to_ids(table[0].content) != n or len(fast) != n + RESERVED:
        raise ValueError(f"added tokens did not land at ids {n} .. {n + RESERVED - 1}")
    fast.chat_template = chat_template or config.get("chat_template")
    if fast.chat_template is None and tokenizer_family(config) == "k3":  # K3 ships none: its prompt is Python
        use_k3_chat_markup(fast)
    return fast


__all__ = [
    "KIMI_PATTERN",
    "RESERVED",
    "K3_ROLES",
    "read_tiktoken",
    "token_content",
    "tokenizer_family",
    "special_token_table",
    "tiktoken_to_fast",
]
