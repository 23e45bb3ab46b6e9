"""The tokenizer folder that `kimi-hf convert k3` (and the Kimi Linear converter, through the same
`convert_tokenizer_dir`) writes from a tiktoken.model loads with AutoTokenizer, without remote code, in
transformers 4.57 as in the installed transformers 5, and behaves the same in both: the same ids for a varied
corpus (K3's chat markup and media tokens, reserved ids, multilingual text, whitespace runs, digits), the same
vocabulary, added tokens and special flags, bos / eos / pad / unk, padding side and model inputs, the same
decoded text, and the same rendered chat template, its ids and its assistant mask. Transformers 5 also behaves
as it did with the folder transformers 5 itself saves (what the converter wrote before it wrote this one, which
transformers 4 cannot load: "Tokenizer class TokenizersBackend does not exist").

transformers 4.57 runs in its own venv (tests/conversion/transformers4_venv.py: built once into the kimi_hf
cache, about 30 s, then reused) as a subprocess running tokenizer_probe.py; transformers 5 runs the same probe
in this process. Without a package index to download from, the tests skip, saying so.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from kimi_hf.conversion import convert_k3
from kimi_hf.conversion.tokenizer import convert_tokenizer_dir, tiktoken_to_fast
from kimi_hf.models.kimi_hybrid.chat_markup_kimi_hybrid import CHAT_TEMPLATE
from kimi_hf.models.kimi_k3.xtml_kimi_k3 import K3_TOKEN_OFFSETS

from ..models.kimi_k3.release_format import tiny_k3_chat_config, write_k3_checkpoint, write_k3_tokenizer_files
from . import transformers4_venv
from .test_tokenizer import REMOTE_TOKENIZER
from .tokenizer_probe import probe


PROBE = Path(__file__).with_name("tokenizer_probe.py")
# tiktoken ranks after the 256 bytes: words of the corpus, whitespace runs, digit groups, CJK characters
MERGES = tuple(
    [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world", b"me", b"ss", b"mess", b"ag"]
    + [b"age", b"message", b"ro", b"le", b"role", b"us", b"er", b"user", b"  ", b"    ", b"\n\n", b"12", b"123"]
    + [s.encode()[:2] for s in "中文"]
    + [s.encode() for s in "中文"]
)
TEXTS = [
    "hello world",
    "Hello World! HELLO wOrLd, hello-world_hello.world",
    '<|open|>message role="user"<|sep|>hello<|close|>message<|sep|><|end_of_msg|>',
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>1 + 2<|close|>think<|sep|><|open|>response<|sep|>3'
    "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>[EOS]",
    "[BOS]hello[EOS][PAD][UNK][BOS]",
    "<|media_begin|>image 28x28<|media_content|><|media_pad|><|media_pad|><|media_pad|><|media_end|>",
    "<|kimi_image_placeholder|>\nWhat is in the picture?",
    "<osagent_mode>[start_header_id]system[end_header_id][EOT]<|reserved_token_300|><|reserved_token_999|>",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "中文文本，中文。日本語のテキスト、한국어 텍스트, русский текст, العربية, ελληνικά, हिन्दी, emoji 🙂👍🏽",
    "  leading spaces,\ttabs\t\tand\n\n\nnewlines \r\n trailing   ",
    "        \n      \n\n\n\n    x",
    "digits 1 12 123 1234 12345 123456 3.14159 -42 1e10 ０１２ ٣٤٥",
    "don't I'LL we've they'RE it's HE'S",
    "<|open|> <|sep|>  <|close|>\n<|end_of_msg|>\n<|open|><|open|>",
    "",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
K3_CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "hello"}], "kwargs": {"add_generation_prompt": True}},
    {
        "messages": [
            {"role": "system", "content": "You are Kimi."},
            {"role": "user", "content": "中文 hello  world 123"},
            {"role": "assistant", "content": "hello world", "reasoning_content": "think 12 + 3"},
        ],
        "kwargs": {"thinking_effort": "low"},
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "weather in Paris?"}]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "metric": True}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18C"},
            {"role": "assistant", "content": "It is 18C in Paris."},
        ],
        "tools": [WEATHER],
        "kwargs": {"enable_thinking": False},
    },
    {
        "messages": [{"role": "user", "content": "hi"}],
        "kwargs": {"add_generation_prompt": True, "thinking_effort": None, "tool_choice": "required"},
    },
]
K2_CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "hello"}], "kwargs": {"add_generation_prompt": True}},
    {
        "messages": [
            {"role": "system", "content": "You are Kimi."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "中文 hello"}]},
            {"role": "assistant", "content": "hello world"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "functions.get_weather:0",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18C"},
        ],
        "tools": [WEATHER],
        "kwargs": {"add_generation_prompt": True},
    },
]
# K2 / K2.5 / Kimi-Linear added tokens by offset from the number of ranks (<|im_end|> at 2: the "k2" family)
K2_ADDED = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    15: "<|im_middle|>",
    17: "<|media_begin|>",
    18: "<|media_content|>",
    19: "<|media_end|>",
    20: "<|media_pad|>",
    21: "<|tool_calls_section_begin|>",
    22: "<|tool_calls_section_end|>",
    23: "<|tool_call_begin|>",
    24: "<|tool_call_argument_begin|>",
    25: "<|tool_call_end|>",
    254: "[UNK]",
    255: "[PAD]",
}
# the keys that name the library, not what the tokenizer does
OWN_KEYS = ("transformers", "class", "trusted_class", "remote_class")


def write_k2_release(folder: Path) -> int:
    """A K2-family release's tokenizer files: tiktoken.model and a tokenizer_config.json with Kimi's chat
    template (no remote code). Returns the number of ranks."""
    n = write_k3_tokenizer_files(folder, merges=MERGES)  # the ranks; its K3 tokenizer_config.json is replaced
    decoder = {str(n + off): {"content": name, "special": True} for off, name in K2_ADDED.items()}
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return n


@pytest.fixture(scope="module")
def transformers4():
    """The transformers 4.57 venv's python (built once into the kimi_hf cache)."""
    t0 = time.time()
    try:
        python = transformers4_venv.python()
    except transformers4_venv.FetchError as err:
        pytest.skip(f"transformers {transformers4_venv.VERSION} could not be downloaded from the package index: {err}")
    print(f"[transformers 4 venv] {transformers4_venv.installed_versions()} ({time.time() - t0:.1f} s)")
    return python


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (release folder, converted folder, what transformers 5 saves for the same tokenizer, ranks)}:
    K3 through `convert_k3` (a tiny release: MXFP4 checkpoint, tiktoken files, remote tokenizer code), the
    K2 family through `convert_tokenizer_dir`."""
    root = tmp_path_factory.mktemp("portable_tokenizer")
    out = {}
    src = root / "k3_release"
    write_k3_checkpoint(src, tiny_k3_chat_config(), seed=0, mxfp4=True, shards=1, dtype="bfloat16")
    n = write_k3_tokenizer_files(src, merges=MERGES)
    (src / "tokenization_kimi.py").write_text(REMOTE_TOKENIZER)
    assert convert_k3(src, root / "k3_converted")["tokenizer_converted"]
    out["k3"] = (src, root / "k3_converted", n)
    src = root / "k2_release"
    src.mkdir()
    m = write_k2_release(src)
    assert convert_tokenizer_dir(str(src), str(root / "k2_converted"))
    out["k2"] = (src, root / "k2_converted", m)
    result = {}
    for family, (src, converted, ranks) in out.items():
        saved = root / f"{family}_saved_by_transformers5"  # the converter's output before: save_pretrained
        tiktoken_to_fast(str(src / "tiktoken.model"), str(src / "tokenizer_config.json")).save_pretrained(saved)
        result[family] = (src, converted, saved, ranks)
    return result


def cases(family: str) -> dict:
    return {
        "texts": TEXTS,
        "pairs": [["hello", "world"], ["中文", " 123"]],
        "conversations": K3_CONVERSATIONS if family == "k3" else K2_CONVERSATIONS,
        "trust_remote_code": True,
        "remote_class": "tokenization_kimi.TikTokenTokenizer" if family == "k3" else None,
    }


def transformers4_report(python: Path, family: str, folder: Path, work: Path) -> dict:
    """The probe's report on `folder` under transformers 4.57 (a subprocess of the venv's python)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps(cases(family)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(work / "modules"), TRANSFORMERS_VERBOSITY="error")
    t0 = time.time()
    r = subprocess.run(
        [str(python), str(PROBE), str(work / "cases.json"), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=work,
        env=env,
    )
    assert r.returncode == 0, f"transformers 4 could not load the converted {family} folder:\n{r.stderr[-3000:]}"
    print(f"[transformers 4 probe] {family}: {time.time() - t0:.1f} s")
    (report,) = json.loads(r.stdout)
    return report


def differences(a: dict, b: dict) -> list[str]:
    """The report keys (and first differing item) where a and b disagree, but for OWN_KEYS."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key in OWN_KEYS or a.get(key) == b.get(key):
            continue
        x, y = a.get(key), b.get(key)
        if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            i = next(i for i, (p, q) in enumerate(zip(x, y)) if p != q)
            out.append(f"{key}[{i}]: {str(x[i])[:300]} != {str(y[i])[:300]}")
        else:
            out.append(f"{key}: {str(x)[:300]} != {str(y)[:300]}")
    return out


@pytest.mark.parametrize("family", ["k3", "k2"])
def test_converted_tokenizer_is_the_same_in_transformers_4_and_5(family, folders, transformers4, tmp_path):
    src, converted, saved, n = folders[family]
    old = transformers4_report(transformers4, family, converted, tmp_path / "transformers4")
    local = {**cases(family), "trust_remote_code": False, "remote_class": None}  # no remote code in this process
    new = probe(str(converted), local)
    assert old["transformers"].startswith("4.57.") and new["transformers"].startswith("5.")
    assert (old["class"], new["class"]) == ("PreTrainedTokenizerFast", "TokenizersBackend")  # the same class in 5.x
    assert differences(old, new) == []
    # transformers 5: what it gave for the folder it saves itself (the converter's output before)
    assert differences(new, probe(str(saved), local)) == []
    # and the right tokenizer, not only the same one: ids by offset from the ranks, the markup matched whole
    assert new["vocab"]["hello"] == 259 and new["len"] == n + 256
    assert new["chats"] and all(c["ids"] for c in new["chats"])
    assert new["roles"] == {
        "bos_token": ["[BOS]", n],
        "eos_token": ["[EOS]", n + 1],
        "pad_token": ["[PAD]", n + 255],
        "unk_token": ["[UNK]", n + 254],
    }
    assert new["encode"][TEXTS.index("[BOS]hello[EOS][PAD][UNK][BOS]")] == [n, 259, n + 1, n + 255, n + 254, n]
    assert new["model_input_names"] == ["input_ids", "attention_mask"] and new["padding_side"] == "left"
    if family == "k3":
        for off, (name, special) in K3_TOKEN_OFFSETS.items():
            assert new["added_tokens"][str(n + off)] == [name, special], name
        markup = new["encode"][2]
        assert markup[0] == n + 3 and markup[-4:] == [n + 4, new["vocab"]["message"], n + 5, n + 2]
        assert new["chats"][3]["text"] == (
            '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|><|open|>message role="system" '
            'type="tool-choice"<|sep|>The system is invoked with `tool_choice=required`.\nYou MUST call tools in the '
            'next message.<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|>'
            "<|open|>think<|sep|>"
        )  # thinking_effort=None: no effort preamble, thinking still on
        assert sum(new["chats"][2]["assistant_masks"]) > 0  # {% generation %} spans, in 4.x too (equal above)
    else:
        k2_prompt = "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
        assert new["chats"][0]["text"] == k2_prompt
    # AutoTokenizer gives this tokenizer with trust_remote_code=True too (the release's auto_map is not kept);
    # the release's own tokenizer code stays in the folder and loads when named (K3's release here ships it)
    assert old["trusted_class"] == "PreTrainedTokenizerFast"
    assert "auto_map" not in json.loads((converted / "tokenizer_config.json").read_text())
    if family == "k3":
        assert "auto_map" in json.loads((src / "tokenizer_config.json").read_text())
        assert old["remote_class"] == "TikTokenTokenizer" and (converted / "tiktoken.model").is_file()
