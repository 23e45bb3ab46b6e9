"""The fine-tuning tests' data: a tiny Kimi K3 in the released layout (MXFP4 experts, K3's tokenizer and chat template)
and chats with tools in TRL's conversational format, written once for the session."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest


def conversation(rng: random.Random, i: int) -> dict:
    """A chat: a system prompt, a question, sometimes a tool call with its result, an answer; some multi-turn."""
    words = "the cat sat on a mat while an old dog slept near the warm fire and rain fell outside".split()

    def text(n):
        return " ".join(rng.choice(words) for _ in range(n))

    messages = [
        {"role": "system", "content": f"You are helper {i}."},
        {"role": "user", "content": text(rng.randint(3, 12))},
    ]
    row = {"messages": messages}
    if i % 3 == 0:
        row["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": "lookup",
                    "description": "Look a word up.",
                    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
                },
            }
        ]
        if i % 2:
            row["tools"] = json.dumps(row["tools"])  # the JSON-string form TRL also takes
        call = {"type": "function", "function": {"name": "lookup", "arguments": {"word": rng.choice(words)}}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "content": text(rng.randint(2, 6)), "tool_call_id": "0"})
    messages.append({"role": "assistant", "content": text(rng.randint(4, 20))})
    if i % 4 == 1:
        messages += [{"role": "user", "content": text(4)}, {"role": "assistant", "content": text(rng.randint(2, 9))}]
    return row


@pytest.fixture(scope="session")
def k3(tmp_path_factory) -> Path:
    """A tiny released-layout K3 (MXFP4 experts) with K3's tokenizer and chat template."""
    import torch

    import kimi_hf
    from kimi_hf.data import stdlib_bytes
    from kimi_hf.presets import small_k3_model
    from kimi_hf.tokenization import train_tokenizer

    folder = tmp_path_factory.mktemp("k3_chat")
    tokenizer = train_tokenizer(stdlib_bytes()[:200_000].decode("utf-8", "ignore"), vocab_size=400, markup="k3")
    torch.manual_seed(0)
    small_k3_model(tokenizer, "tiny", 84).save_pretrained(folder, saved_experts="mxfp4")
    kimi_hf.KimiK3Processor(kimi_hf.KimiK3ImageProcessor(), tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def chats(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("chats")
    rng = random.Random(0)
    data = {}
    for name, count in (("train", 40), ("eval", 6)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(conversation(rng, i)) + "\n" for i in range(count)))
        data[name] = path
    return data
