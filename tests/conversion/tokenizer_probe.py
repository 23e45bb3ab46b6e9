"""What a saved tokenizer folder does, as plain JSON, under whichever transformers imports it.

Run by test_tokenizer_transformers4.py in a transformers 4.57 virtual environment (this file imports only the
standard library and transformers: neither kimi_hf nor torch is there) and imported by the same test under the
installed transformers 5, so the two reports can be compared key by key.

    python tokenizer_probe.py CASES.json FOLDER [FOLDER ...]   prints [probe(FOLDER, CASES), ...] as one JSON line

CASES: {"texts": [str, ...], "pairs": [[str, str], ...], "conversations": [{"messages": [...], "tools": ...,
"kwargs": {...}}, ...], "trust_remote_code": bool, "remote_class": "module.Class"}. With "trust_remote_code", the
report also names the class AutoTokenizer picks with trust_remote_code=True ("trusted_class"); with
"remote_class", the class of `remote_class.from_pretrained(FOLDER)`, the folder's own code named explicitly
("remote_class"). Everything else is AutoTokenizer's default load (no remote code).
"""

from __future__ import annotations

import json
import sys


def _jsonable(value):
    """BatchEncoding / tuples / AddedToken-free values -> JSON types (lists, dicts, str, int)."""
    if hasattr(value, "keys"):
        return {str(k): _jsonable(value[k]) for k in value.keys()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def probe(folder: str, cases: dict) -> dict:
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    texts, pairs = cases["texts"], cases.get("pairs", [])
    report = {
        "transformers": transformers.__version__,
        "class": type(tok).__name__,
        "is_fast": bool(getattr(tok, "is_fast", False)),
        "len": len(tok),
        "vocab": tok.get_vocab(),
        "added_tokens": {str(i): [t.content, bool(t.special)] for i, t in sorted(tok.added_tokens_decoder.items())},
        "roles": {
            role: [getattr(tok, role), getattr(tok, role + "_id")]
            for role in ("bos_token", "eos_token", "pad_token", "unk_token")
        },
        "all_special_tokens": sorted(tok.all_special_tokens),
        "all_special_ids": sorted(tok.all_special_ids),
        "padding_side": tok.padding_side,
        "truncation_side": tok.truncation_side,
        "model_input_names": list(tok.model_input_names),
        "chat_template": tok.chat_template,
        "encode": [tok.encode(t) for t in texts],
        "encode_plain": [tok.encode(t, add_special_tokens=False) for t in texts],
        "tokens": [tok.convert_ids_to_tokens(tok.encode(t)) for t in texts],
        "call": [_jsonable(tok(t)) for t in texts],
        "pairs": [_jsonable(tok(a, b)) for a, b in pairs],
        "decode": [tok.decode(tok.encode(t)) for t in texts],
        "decode_skip": [tok.decode(tok.encode(t), skip_special_tokens=True) for t in texts],
        "batch": _jsonable(tok(texts[:4], padding=True)),
        "chats": [],
    }
    for chat in cases.get("conversations", []):
        kwargs = dict(chat.get("kwargs", {}))
        text = tok.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=False, **kwargs)
        entry = {"text": text, "ids": tok.encode(text, add_special_tokens=False)}
        if not kwargs.get("add_generation_prompt"):  # the {% generation %} spans: what a trainer's mask covers
            out = tok.apply_chat_template(
                chat["messages"],
                tools=chat.get("tools"),
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **kwargs,
            )
            entry["mask_ids"] = _jsonable(out["input_ids"])
            entry["assistant_masks"] = _jsonable(out["assistant_masks"])
        report["chats"].append(entry)
    if cases.get("trust_remote_code"):
        report["trusted_class"] = type(AutoTokenizer.from_pretrained(folder, trust_remote_code=True)).__name__
    if cases.get("remote_class"):
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module(cases["remote_class"], folder)
        report["remote_class"] = type(cls.from_pretrained(folder)).__name__
    return report


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    print(json.dumps([probe(folder, cases) for folder in sys.argv[2:]], ensure_ascii=True))
