"""Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json) -> a fast tokenizer (tokenizer.json).

Kimi's repositories ship `tiktoken.model` (one "base64(token) rank" line per token) and
`tokenization_kimi.py` (remote code needing the `tiktoken` package). The fast tokenizer is byte-level
BPE over the same ranks: merges are every (left, right) split of a token whose halves are tokens,
ordered by the merged token's rank, with `ignore_merges` (tiktoken looks a whole piece up before
merging); the pre-tokenizer splits with Kimi's pattern; the 256 ids after the ranks are added tokens,
named by tokenizer_config.json's added_tokens_decoder or `<|reserved_token_{id}|>`, special unless the
config marks them `"special": false`. No `tiktoken` package is needed.

Two families share the format and differ in the added tokens (ids by offset from the number of ranks,
163584 in the released files; the offsets let tiny test vocabularies use the same table):

- Kimi K2 / K2.5 / Kimi-Linear: chat markup `<|im_user|>` ... `<|im_end|>` (turn end at offset 2).
- Kimi K3: XTML markup `<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>`
  (`K3_SPECIAL_TOKENS`). `<|close|>` and `<|sep|>` are not special: they decode literally, also with
  `skip_special_tokens=True`. The tokenizer's eos is `[EOS]` (end of document), while K3's config and
  generation stop at `<|end_of_msg|>` (end of turn): `chat_stop_token_ids` / `generation_token_ids`.

The family is read off tokenizer_config.json's added_tokens_decoder (`tokenizer_family`), not a flag.

The folder `convert_tokenizer_dir` writes loads with AutoTokenizer (no remote code) in transformers 4.x and
5.x alike, with the same ids, special tokens and chat template (`portable_tokenizer_config`):
tokenizer_config.json names `PreTrainedTokenizerFast` (transformers 5's own save names `TokenizersBackend`, a
class 4.x lacks; in 5.x `PreTrainedTokenizerFast` is an alias of it), lists the special tokens beyond bos / eos /
pad / unk as `additional_special_tokens` (5.x saves a list under `extra_special_tokens`, which 4.x takes for a
dict of named tokens and fails on), states `model_input_names` (4.x's default adds token_type_ids) and carries
the added tokens' `added_tokens_decoder` again; the chat template is chat_template.jinja, which both read
(4.57 prefers it to a tokenizer_config.json entry). The release's tokenizer_config.json is replaced and its
auto_map not kept (AutoTokenizer gives the fast tokenizer with trust_remote_code=True too, and a folder saved
from it names no remote code it lacks); tiktoken.model and the remote code stay beside it (the converters copy
them), and the release's class still loads from the folder when named
(`get_class_from_dynamic_module("tokenization_kimi.TikTokenTokenizer", folder).from_pretrained(folder)`): the new
config keeps what it reads (added_tokens_decoder, bos / eos / pad / unk).
"""

from __future__ import annotations

import base64
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..atomic_io import atomic_write
from ..models.kimi_hybrid.chat_markup_kimi_hybrid import chat_stop_token_ids  # K3: <|end_of_msg|>, [EOS]
from ..models.kimi_k3.chat_template_kimi_k3 import K3_STOP_TOKEN, K3_TOKEN_OFFSETS, use_k3_chat_markup


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

K3_SPECIAL_TOKENS = K3_TOKEN_OFFSETS  # K3's added tokens by offset (one table, beside K3's chat template)
K3_TURN_END = K3_STOP_TOKEN
K2_TURN_END = "<|im_end|>"
# the roles K3's tokenizer_config.json gives its tokens, used where a K3 config leaves one out
K3_ROLES = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}


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


def _content(value) -> str | None:
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
        names = {_content(v) for v in (source.get("added_tokens_decoder") or {}).values()}
    else:
        names = {t.content for t in source.added_tokens_decoder.values()}
    if K3_TURN_END in names and "<|open|>" in names:
        return "k3"
    if K2_TURN_END in names:
        return "k2"
    return None


def special_token_table(config: dict, n_ranks: int) -> list[AddedToken]:
    """The RESERVED added tokens at ids n_ranks .. n_ranks + 255, in id order: named and flagged by the
    config's added_tokens_decoder (`special` defaults to true, or to K3_SPECIAL_TOKENS' flag for a K3
    name), else `<|reserved_token_{id}|>` (special). Matched whole, never normalised or stripped unless
    the config says so."""
    decoder = {int(k): v for k, v in (config.get("added_tokens_decoder") or {}).items()}
    outside = sorted(i for i in decoder if not n_ranks <= i < n_ranks + RESERVED)
    if outside:
        raise ValueError(
            f"added_tokens_decoder ids {outside[:5]} lie outside the {RESERVED} ids after the {n_ranks} ranks"
        )
    k3_flags = dict(K3_SPECIAL_TOKENS.values()) if tokenizer_family(config) == "k3" else {}
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
    roles = {key: _content(config.get(key)) for key in K3_ROLES}
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


# a tokenizer class that transformers 4.x and 5.x both have (5.x: an alias of TokenizersBackend)
PORTABLE_TOKENIZER_CLASS = "PreTrainedTokenizerFast"
_ADDED_TOKEN_FLAGS = ("lstrip", "normalized", "rstrip", "single_word", "special")


def portable_tokenizer_config(saved: dict, tokenizer) -> dict:
    """`saved` (the tokenizer_config.json transformers 5 writes for `tokenizer`) -> one that transformers 4.x
    (4.57 checked) loads the same way: tokenizer_class PreTrainedTokenizerFast instead of 5.x's TokenizersBackend,
    a list of `extra_special_tokens` as `additional_special_tokens` (5.x reads that name too), `model_input_names`
    and `clean_up_tokenization_spaces` stated (4.x's defaults differ or differed), and `added_tokens_decoder`
    (4.x's own format, which the release's tiktoken tokenizer reads too). No auto_map: AutoTokenizer loads
    tokenizer.json, with or without trust_remote_code."""
    cfg = dict(saved)
    cfg["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, dict) and extra:  # named extra tokens: 4.x reads that form as it is
        cfg["extra_special_tokens"] = extra
    elif extra:
        cfg["additional_special_tokens"] = [_content(t) or str(t) for t in extra]
    cfg["added_tokens_decoder"] = {
        str(i): {"content": t.content, **{k: bool(getattr(t, k)) for k in _ADDED_TOKEN_FLAGS}}
        for i, t in sorted(tokenizer.added_tokens_decoder.items())
    }
    cfg["model_input_names"] = list(tokenizer.model_input_names)
    cfg["clean_up_tokenization_spaces"] = bool(tokenizer.clean_up_tokenization_spaces)
    cfg.pop("auto_map", None)
    return dict(sorted(cfg.items()))


def save_portable_tokenizer(tokenizer, folder: str) -> None:
    """tokenizer.save_pretrained(folder), with the tokenizer_config.json of `portable_tokenizer_config`."""
    tokenizer.save_pretrained(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    cfg = portable_tokenizer_config(saved, tokenizer)
    atomic_write(path, json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def generation_token_ids(tokenizer) -> dict:
    """bos / eos / pad ids for a generation_config.json (or a model config) of this tokenizer's model:
    eos is `chat_stop_token_ids` (K3 released: bos 163584, eos [163586, 163585], pad 163839)."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": chat_stop_token_ids(tokenizer)}
    ids["pad_token_id"] = tokenizer.pad_token_id
    return {k: v for k, v in ids.items() if v is not None and v != []}


def convert_tokenizer_dir(src: str, dst: str) -> bool:
    """Writes tokenizer.json (+ tokenizer_config.json, chat_template.jinja) into dst when src has a tiktoken.model
    and no tokenizer.json: a folder that AutoTokenizer loads alike in transformers 4.x and 5.x
    (`portable_tokenizer_config`). Returns whether it did."""
    model = os.path.join(src, "tiktoken.model")
    if not os.path.exists(model) or os.path.exists(os.path.join(src, "tokenizer.json")):
        return False
    template = None
    if os.path.exists(os.path.join(src, "chat_template.jinja")):
        with open(os.path.join(src, "chat_template.jinja")) as f:
            template = f.read()
    fast = tiktoken_to_fast(model, os.path.join(src, "tokenizer_config.json"), chat_template=template)
    save_portable_tokenizer(fast, dst)
    return True


def stop_generation_at_turn_end(folder: str, config: dict | None) -> None:
    """For a converted folder with a tokenizer.json: the generation config (written from `config`'s bos / eos /
    pad ids when the folder has none) also stops where the tokenizer's chat markup ends a turn (`<|im_end|>`;
    K3: `<|end_of_msg|>`, then `[EOS]`)."""
    from transformers import AutoTokenizer, GenerationConfig

    from ..models.kimi_hybrid.chat_markup_kimi_hybrid import stop_at_turn_end

    if config is not None and not os.path.exists(os.path.join(folder, "generation_config.json")):
        ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(folder)
    stop_at_turn_end(folder, AutoTokenizer.from_pretrained(folder))


__all__ = [
    "KIMI_PATTERN",
    "stop_generation_at_turn_end",
    "K3_SPECIAL_TOKENS",
    "read_tiktoken",
    "tokenizer_family",
    "special_token_table",
    "tiktoken_to_fast",
    "chat_stop_token_ids",
    "generation_token_ids",
    "convert_tokenizer_dir",
    "PORTABLE_TOKENIZER_CLASS",
    "portable_tokenizer_config",
    "save_portable_tokenizer",
]
