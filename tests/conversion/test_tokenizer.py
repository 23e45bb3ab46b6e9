"""Kimi's tiktoken files -> a fast tokenizer (no `tiktoken` package): the ranks' BPE with Kimi's split
pattern, the 256 reserved special ids, Kimi K3's added tokens (XTML markup, two of them not special), and
the conversion tool writing tokenizer.json next to the weights."""

import base64
import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from kimi_hf.conversion.tokenizer import (
    K3_ROLES,
    chat_stop_token_ids,
    convert_tokenizer_dir,
    generation_token_ids,
    read_tiktoken,
    tiktoken_to_fast,
    tokenizer_family,
)
from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import K3_CHAT_TEMPLATE, K3_RESPONSE_TEMPLATE
from kimi_hf.models.kimi_k3.xtml_kimi_k3 import K3_TOKEN_OFFSETS

from .test_convert_kimi_linear import convert_kimi_linear, native_dir  # noqa: F401  (fixture)


EXTRA = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", "中".encode()[:2], "中".encode()]


def write_ranks(folder, extra=EXTRA):
    """tiktoken.model: the 256 bytes, then `extra` by rank. Returns the number of ranks."""
    ranks = {bytes([b]): b for b in range(256)}
    for t in extra:
        ranks[t] = len(ranks)
    with open(folder / "tiktoken.model", "wb") as f:
        for t, r in ranks.items():
            f.write(base64.b64encode(t) + b" " + str(r).encode() + b"\n")
    return len(ranks)


def write_kimi_tokenizer(folder):
    n = write_ranks(folder)
    cfg = {
        "added_tokens_decoder": {
            str(n): {"content": "[BOS]", "special": True},
            str(n + 1): {"content": "[EOS]", "special": True},
            str(n + 2): {"content": "<|im_end|>", "special": True},
            str(n + 5): {"content": "<|media_pad|>", "special": True},
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return n


def test_tiktoken_ranks_become_the_same_bpe(tmp_path):
    n = write_kimi_tokenizer(tmp_path)
    fast = tiktoken_to_fast(str(tmp_path / "tiktoken.model"), str(tmp_path / "tokenizer_config.json"))
    assert fast.encode("hello world") == [259, 264]  # "hello", " world": whole pieces, by rank
    assert fast.encode("hello 中中") == [259, 32, 266, 266]  # Han runs split apart, the multi-byte rank used
    assert fast.decode(fast.encode("Hello World! 中文")) == "Hello World! 中文"
    assert fast.bos_token_id == n and fast.eos_token_id == n + 1
    assert fast.convert_tokens_to_ids("<|media_pad|>") == n + 5 and fast.encode("<|media_pad|>") == [n + 5]
    assert fast.convert_tokens_to_ids(f"<|reserved_token_{n + 3}|>") == n + 3 and len(fast) == n + 256
    assert fast.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_malformed_tiktoken_files_name_the_line(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"aGk= 0\nnot-base64 1\n")
    with pytest.raises(ValueError, match=r"bad.model:2"):
        read_tiktoken(str(tmp_path / "bad.model"))


def test_conversion_writes_tokenizer_json(native_dir, tmp_path):  # noqa: F811
    path, _ = native_dir
    src = tmp_path / "src"
    shutil.copytree(path, src)
    write_kimi_tokenizer(src)
    summary = convert_kimi_linear.main([str(src), str(tmp_path / "ours"), "--no-progress"])
    assert summary["fast_tokenizer"] and (tmp_path / "ours" / "tokenizer.json").exists()
    tok = AutoTokenizer.from_pretrained(tmp_path / "ours")
    assert tok.encode("hello world") == [259, 264]
    assert tok.padding_side == "left"  # for batched generation
    # chat turns end with <|im_end|>: the converted folder's generation config stops there as well as at EOS
    eos = json.loads((tmp_path / "ours" / "generation_config.json").read_text())["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else eos
    assert tok.eos_token_id in eos and tok.convert_tokens_to_ids("<|im_end|>") in eos


# ---- Kimi K3 ----
K3_EXTRA = [b"me", b"ss", b"mess", b"ag", b"age", b"message", b"ro", b"le", b"role", b"us", b"er", b"user", b"hi"]
K3_MARKUP = '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'


def write_k3_tokenizer(folder, flags=True):
    """K3's tiktoken files at a reduced vocabulary: its added tokens at the same offsets from the number
    of ranks as the released 163584 (tokenizer_config.json as K3 writes it: AddedToken dicts with their
    `special` flags; `flags=False` leaves the flags out). Returns the number of ranks."""
    n = write_ranks(folder, K3_EXTRA)

    def entry(name, special):
        e = {"content": name, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
        return e | ({"special": special} if flags else {})

    decoder = {str(n + off): entry(name, special) for off, (name, special) in K3_TOKEN_OFFSETS.items()}
    for off in range(256):  # K3 names the reserved ids too, by their own id
        decoder.setdefault(str(n + off), entry(f"<|reserved_token_{n + off}|>", True))
    cfg = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return n


def k3_fast(folder, **kwargs):
    n = write_k3_tokenizer(folder, **kwargs)
    return n, tiktoken_to_fast(str(folder / "tiktoken.model"), str(folder / "tokenizer_config.json"))


def test_k3_table_is_the_released_one():
    # the released ids (163584 ranks), as K3's tokenizer_config.json lists them
    released = {163584 + off: name for off, (name, _) in K3_TOKEN_OFFSETS.items()}
    assert released == {
        163584: "[BOS]",
        163585: "[EOS]",
        163586: "<|end_of_msg|>",
        163587: "<|open|>",
        163588: "<|close|>",
        163589: "<|sep|>",
        163590: "[start_header_id]",
        163591: "[end_header_id]",
        163593: "[EOT]",
        163602: "<|media_begin|>",
        163603: "<|media_content|>",
        163604: "<|media_end|>",
        163605: "<|media_pad|>",
        163649: "<osagent_mode>",
        163838: "[UNK]",
        163839: "[PAD]",
    }
    assert [name for name, special in K3_TOKEN_OFFSETS.values() if not special] == ["<|close|>", "<|sep|>"]


@pytest.mark.parametrize("flags", [True, False], ids=["config_flags", "k3_default_flags"])
def test_k3_ids_and_special_flags(tmp_path, flags):
    n, fast = k3_fast(tmp_path, flags=flags)
    assert len(fast) == n + 256
    for off, (name, special) in K3_TOKEN_OFFSETS.items():
        assert fast.convert_tokens_to_ids(name) == n + off, name
        assert fast.added_tokens_decoder[n + off].special is special, name
        assert fast.encode(name) == [n + off], name  # matched whole
    assert fast.convert_tokens_to_ids(f"<|reserved_token_{n + 8}|>") == n + 8
    assert fast.added_tokens_decoder[n + 8].special
    assert (fast.bos_token, fast.eos_token, fast.pad_token, fast.unk_token) == ("[BOS]", "[EOS]", "[PAD]", "[UNK]")
    assert (fast.bos_token_id, fast.eos_token_id, fast.pad_token_id) == (n, n + 1, n + 255)
    assert "<|close|>" not in fast.all_special_tokens and "<|open|>" in fast.all_special_tokens


def test_k3_markup_round_trip(tmp_path):
    n, fast = k3_fast(tmp_path)
    ids = fast.encode(K3_MARKUP)
    w = fast.convert_tokens_to_ids  # the BPE words by rank; " role" is no rank: a space, then "role"
    open_, close, sep, end = n + 3, n + 4, n + 5, n + 2
    head = [open_, w("message"), 32, w("role"), 61, 34, w("user"), 34, sep]  # <|open|>message role="user"<|sep|>
    assert ids == head + [w("hi"), close, w("message"), sep, end]
    assert fast.decode(ids) == K3_MARKUP
    # <|close|> / <|sep|> are not special: they stay; <|open|> / <|end_of_msg|> go
    assert fast.decode(ids, skip_special_tokens=True) == 'message role="user"<|sep|>hi<|close|>message<|sep|>'
    assert fast.encode(K3_MARKUP, add_special_tokens=True) == ids  # K3 prepends no BOS


def test_k3_family_and_generation_ids(tmp_path):
    n, fast = k3_fast(tmp_path)
    assert tokenizer_family(str(tmp_path / "tokenizer_config.json")) == "k3" and tokenizer_family(fast) == "k3"
    # the tokenizer's eos is [EOS] (end of document); chat stops at <|end_of_msg|> (K3's config eos) first
    assert fast.eos_token_id == n + 1
    assert chat_stop_token_ids(fast) == [n + 2, n + 1]
    assert generation_token_ids(fast) == {"bos_token_id": n, "eos_token_id": [n + 2, n + 1], "pad_token_id": n + 255}
    k2 = tmp_path / "k2"
    k2.mkdir()
    m = write_kimi_tokenizer(k2)
    k2_fast = tiktoken_to_fast(str(k2 / "tiktoken.model"), str(k2 / "tokenizer_config.json"))
    assert tokenizer_family(str(k2 / "tokenizer_config.json")) == "k2" == tokenizer_family(k2_fast)
    assert chat_stop_token_ids(k2_fast) == [m + 1, m + 2]  # [EOS], <|im_end|>


def test_k3_saved_folder_reloads(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    n = write_k3_tokenizer(src)
    assert convert_tokenizer_dir(str(src), str(dst))
    assert not convert_tokenizer_dir(str(dst), str(tmp_path / "again"))  # a tokenizer.json is there already
    tok = AutoTokenizer.from_pretrained(dst)
    # K3 ships no chat template (its prompt is built in Python): the converted tokenizer carries K3's
    assert len(tok) == n + 256 and tok.chat_template == K3_CHAT_TEMPLATE
    assert tok.response_template == K3_RESPONSE_TEMPLATE
    for off, (name, special) in K3_TOKEN_OFFSETS.items():
        assert tok.convert_tokens_to_ids(name) == n + off and tok.added_tokens_decoder[n + off].special is special
    ids = tok.encode(K3_MARKUP)
    assert tok.decode(ids) == K3_MARKUP
    assert tok.decode(ids, skip_special_tokens=True) == 'message role="user"<|sep|>hi<|close|>message<|sep|>'
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (n, n + 1, n + 255)
    assert chat_stop_token_ids(tok) == [n + 2, n + 1]


def test_added_tokens_outside_the_reserved_ids_raise(tmp_path):
    n = write_ranks(tmp_path)
    cfg = {"added_tokens_decoder": {str(n + 256): {"content": "<|late|>", "special": True}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=str(n + 256)):
        tiktoken_to_fast(str(tmp_path / "tiktoken.model"), str(tmp_path / "tokenizer_config.json"))


# the release's remote tokenizer (tokenization_kimi.TikTokenTokenizer), as far as these tests look: which class
# AutoTokenizer picks
REMOTE_TOKENIZER = '''"""Stands in for the release's tiktoken tokenizer (remote code)."""
from transformers import PreTrainedTokenizerFast


class TikTokenTokenizer(PreTrainedTokenizerFast):
    vocab_files_names = {"vocab_file": "tiktoken.model", "tokenizer_file": "tokenizer.json"}
'''
RELEASE_AUTO_MAP = {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None], "AutoProcessor": "proc.P"}


def test_saved_tokenizer_config_is_one_transformers_4_loads(tmp_path):
    """What transformers 4.x needs of tokenizer_config.json (test_tokenizer_transformers4.py loads the folder
    there): a class it has (not 5.x's TokenizersBackend), the extra special tokens as a list under the name it
    reads (5.x's list under `extra_special_tokens` is a dict of named tokens to 4.x), model_input_names stated
    (4.x's default adds token_type_ids), the added tokens; the chat template in chat_template.jinja. The release's
    auto_map is not kept: AutoTokenizer gives tokenizer.json's tokenizer with trust_remote_code=True too, while the
    release's remote tokenizer (beside it in the folder) still loads when named."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    n = write_k3_tokenizer(src)
    release = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**release, "auto_map": RELEASE_AUTO_MAP}))
    (dst / "tokenization_kimi.py").write_text(REMOTE_TOKENIZER)  # copied beside it, as the converters do
    assert convert_tokenizer_dir(str(src), str(dst))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "extra_special_tokens" not in cfg
    fast = tiktoken_to_fast(str(src / "tiktoken.model"), str(src / "tokenizer_config.json"))
    table = sorted(fast.added_tokens_decoder.items())
    roles = set(K3_ROLES.values())
    assert cfg["additional_special_tokens"] == [t.content for _, t in table if t.special and t.content not in roles]
    assert len(cfg["additional_special_tokens"]) == 256 - 2 - 4  # all but <|close|>, <|sep|> and the four roles
    assert {int(i): (e["content"], e["special"]) for i, e in cfg["added_tokens_decoder"].items()} == {
        i: (t.content, t.special) for i, t in table
    }
    assert cfg["model_input_names"] == ["input_ids", "attention_mask"] and cfg["clean_up_tokenization_spaces"] is False
    assert [cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")] == [
        "[BOS]",
        "[EOS]",
        "[PAD]",
        "[UNK]",
    ]
    assert "chat_template" not in cfg and (dst / "chat_template.jinja").is_file() and "auto_map" not in cfg
    # transformers 5 (this process): the same tokenizer as the one built in memory
    tok = AutoTokenizer.from_pretrained(dst)
    assert type(tok).__name__ == "TokenizersBackend" and len(tok) == n + 256
    assert tok.encode(K3_MARKUP) == fast.encode(K3_MARKUP) and tok("hi").keys() == {"input_ids", "attention_mask"}
    assert tok.all_special_tokens == fast.all_special_tokens
    # remote code (a fresh process, its module cache in tmp): not through AutoTokenizer, but when named
    code = (
        "import sys; from transformers import AutoTokenizer as A; "
        "from transformers.dynamic_module_utils import get_class_from_dynamic_module as g; "
        "print(type(A.from_pretrained(sys.argv[1], trust_remote_code=True)).__name__, "
        "type(g('tokenization_kimi.TikTokenTokenizer', sys.argv[1]).from_pretrained(sys.argv[1])).__name__)"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(dst)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["TokenizersBackend", "TikTokenTokenizer"], r.stderr[-2000:]
