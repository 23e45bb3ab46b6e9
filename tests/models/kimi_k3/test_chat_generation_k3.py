"""End to end on a tiny random Kimi K3 checkpoint in the released layout (MXFP4 experts, the release's tokenizer
and image-processor files): AutoProcessor + AutoModelForImageTextToText load it, the model is taught one reply
to an image question (a few optimizer steps), then `apply_chat_template` with the image -> `generate` writes
that reply in K3's markup and stops at `<|end_of_msg|>`, and `pipeline("image-text-to-text")` returns it as an
assistant message."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline

from kimi_hf.models.kimi_k3.reply_parser_kimi_k3 import parse_k3_reply

from .release_format import (
    TINY_CHAT_IDS,
    tiny_k3_chat_config,
    write_k3_checkpoint,
    write_k3_preprocessor_config,
    write_k3_tokenizer_files,
)


END_OF_MSG = TINY_CHAT_IDS["eos_token_id"]  # <|end_of_msg|>: K3's config eos


def question():
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (28, 56, 3), dtype=np.uint8))
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "how many?"}]}]


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3_chat")
    write_k3_checkpoint(folder, tiny_k3_chat_config(), seed=0, mxfp4=True, shards=2)
    write_k3_tokenizer_files(folder)
    write_k3_preprocessor_config(folder)
    processor = AutoProcessor.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    messages = question()
    options = {"thinking_effort": None, "tokenize": True, "return_dict": True, "return_tensors": "pt"}
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, **options)
    full = processor.apply_chat_template(messages + [{"role": "assistant", "content": "two"}], **options)
    labels = full["input_ids"].clone()
    labels[:, : prompt["input_ids"].shape[1]] = -100  # the reply only
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(40):
        model(**full, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), processor, prompt


def test_the_release_folder_loads_with_k3_generation_settings(taught):
    model, _, _ = taught
    # the release's config.json keeps transformers 4.x generation defaults (max_length 20, ...) in its
    # text_config: they are boilerplate, not generation settings
    assert model.generation_config.eos_token_id == END_OF_MSG
    assert model.generation_config.to_diff_dict().keys() - {"transformers_version", "_from_model_config"} <= {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
    }


def test_generate_writes_the_reply_and_stops_at_end_of_msg(taught):
    model, processor, prompt = taught
    n = prompt["input_ids"].shape[1]
    out = model.generate(**prompt, max_new_tokens=80, do_sample=False)
    new = out[0, n:].tolist()
    assert new[-1] == END_OF_MSG and new.count(END_OF_MSG) == 1 and len(new) < 80
    text = processor.decode(new, skip_special_tokens=False)
    assert text == (
        "<|close|>think<|sep|><|open|>response<|sep|>two<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    prefix = processor.decode(prompt["input_ids"][0], skip_special_tokens=False)
    assert parse_k3_reply(text, prefix=prefix) == {
        "role": "assistant",
        "reasoning_content": "",
        "content": "two",
        "tool_calls": [],
    }


def test_pipeline_returns_the_reply(taught):
    model, processor, _ = taught
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    result = pipe(text=question(), max_new_tokens=80, generate_kwargs={"do_sample": False}, thinking_effort=None)
    reply = result[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and reply["content"] == "two"


def test_a_pipeline_reply_without_a_response_channel_has_content(taught):
    """Cut after the think channel (two tokens: `<|close|>think<|sep|>`), the reply has no response channel; the
    parsed assistant message still has `content` (empty), as transformers' own parsed messages do (issue 24 item 4)."""
    model, processor, _ = taught
    pipe = pipeline("image-text-to-text", model=model, processor=processor)
    result = pipe(text=question(), max_new_tokens=2, generate_kwargs={"do_sample": False}, thinking_effort=None)
    reply = result[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and reply["content"] == "", reply
    assert "tool_calls" not in reply


def test_parsed_replies_always_carry_content():
    """Both markups' response templates: a reply of tool calls only, or of nothing, parses to a message with
    `content` (empty)."""
    from transformers.utils.chat_parsing.response_parser import parse_response

    from kimi_hf.models.kimi_hybrid.chat_markup_kimi_hybrid import RESPONSE_TEMPLATE
    from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import K3_RESPONSE_TEMPLATE

    k3 = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    call = '<|open|>call tool="f"<|sep|><|open|>argument key="a"<|sep|>1<|close|>argument<|sep|><|close|>call<|sep|>'
    parsed = parse_response(f"<|close|>think<|sep|>{call}<|end_of_msg|>", K3_RESPONSE_TEMPLATE, prefix=k3)
    assert parsed["content"] == "" and parsed["tool_calls"][0]["function"]["name"] == "f"
    kimi = "<|im_assistant|>assistant<|im_middle|>"
    calls = '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}'
    calls += "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
    assert parse_response(calls, RESPONSE_TEMPLATE, prefix=kimi)["content"] == ""
    assert parse_response("<|im_end|>", RESPONSE_TEMPLATE, prefix=kimi) == {"role": "assistant", "content": ""}
