"""Kimi's tiktoken tokenizer (tiktoken.model + tokenizer_config.json) -> a converted folder (tokenizer.json).

The reading itself (tiktoken.model -> a fast tokenizer: byte-level BPE over the same ranks, Kimi's split pattern,
the 256 added tokens after the ranks; no `tiktoken` package) is `kimi_hf.models.kimi_k3.tokenization_kimi_k3`'s,
beside K3's model code, so that a K3 Hub folder reads a released folder without kimi_hf; this module re-exports
it (`tiktoken_to_fast`, `read_tiktoken`, `tokenizer_family`, ...) and writes the converted folder.

Two families share the format and differ in the added tokens (ids by offset from the number of ranks,
163584 in the released files; the offsets let tiny test vocabularies use the same table):

- Kimi K2 / K2.5 / Kimi-Linear: chat markup `<|im_user|>` ... `<|im_end|>` (turn end at offset 2).
- Kimi K3: XTML markup `<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>`
  (`K3_TOKEN_OFFSETS`). `<|close|>` and `<|sep|>` are not special: they decode literally, also with
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

import json
import os

from ..atomic_io import atomic_write
from ..chat import chat_stop_token_ids  # K3: <|end_of_msg|>, [EOS]
from ..models.kimi_hybrid.chat_markup_kimi_hybrid import add_eos_token_ids
from ..models.kimi_k3.tokenization_kimi_k3 import (  # the reader, beside K3's model code (re-exported)
    K3_ROLES,
    KIMI_PATTERN,
    read_tiktoken,
    special_token_table,
    tiktoken_to_fast,
    token_content,
    tokenizer_family,
)


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
        cfg["additional_special_tokens"] = [token_content(t) or str(t) for t in extra]
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


def load_fast_tokenizer(folder: str):
    """The fast tokenizer of a folder with a tokenizer.json (and its tokenizer_config.json: special tokens, chat
    template), never running remote code: not AutoTokenizer, which reads config.json too and, for a release whose
    config.json or tokenizer_config.json has an auto_map (Kimi's tokenization_kimi.py, configuration_kimi_k3.py),
    asks "Do you wish to run the custom code? [y/N]" on the terminal, or stalls 15 s for an answer. The converters
    only need the vocabulary and the special tokens, which tokenizer.json holds."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(folder)


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
    from transformers import GenerationConfig

    if config is not None and not os.path.exists(os.path.join(folder, "generation_config.json")):
        ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        GenerationConfig(**{k: v for k, v in ids.items() if v is not None}).save_pretrained(folder)
    add_eos_token_ids(folder, chat_stop_token_ids(load_fast_tokenizer(folder)))


__all__ = [
    "KIMI_PATTERN",
    "stop_generation_at_turn_end",
    "K3_ROLES",
    "read_tiktoken",
    "tokenizer_family",
    "special_token_table",
    "tiktoken_to_fast",
    "chat_stop_token_ids",
    "generation_token_ids",
    "convert_tokenizer_dir",
    "load_fast_tokenizer",
    "PORTABLE_TOKENIZER_CLASS",
    "portable_tokenizer_config",
    "save_portable_tokenizer",
]
