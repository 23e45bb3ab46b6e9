"""Kimi's tiktoken files -> a fast tokenizer (no `tiktoken` package): the ranks' BPE with Kimi's split
pattern, the 256 reserved special ids, and the conversion tool writing tokenizer.json next to the weights."""

import base64
import json
import shutil

import pytest
from transformers import AutoTokenizer

from kimi_hf.conversion.tokenizer import read_tiktoken, tiktoken_to_fast

from .test_convert_kimi_linear import convert_kimi_linear, native_dir  # noqa: F401  (fixture)


EXTRA = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", "中".encode()[:2], "中".encode()]


def write_kimi_tokenizer(folder):
    ranks = {bytes([b]): b for b in range(256)}
    for t in EXTRA:
        ranks[t] = len(ranks)
    with open(folder / "tiktoken.model", "wb") as f:
        for t, r in ranks.items():
            f.write(base64.b64encode(t) + b" " + str(r).encode() + b"\n")
    n = len(ranks)
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
