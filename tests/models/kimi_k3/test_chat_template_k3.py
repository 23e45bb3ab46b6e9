"""Kimi K3's chat markup (XTML) through stock transformers: the Jinja template renders what K3's encoder
(encoding_k3.py) writes, the replies parse back (our parser and transformers' parse_response), malformed
replies fail clearly (or come back as a plain reply), and the assistant mask covers exactly the replies.

The expected strings are written out by hand from K3.md §3.10 and the public ports of encoding_k3.py, not
produced by the template."""

import base64
import json
import random

import jinja2
import pytest
from transformers import AutoTokenizer

from kimi_hf.conversion.tokenizer import tiktoken_to_fast
from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import (
    K3_CHAT_TEMPLATE,
    K3_RESPONSE_TEMPLATE,
    k3_stop_token_ids,
    normalize_k3_messages,
    use_k3_chat_markup,
)
from kimi_hf.models.kimi_k3.reply_parser_kimi_k3 import K3ReplyError, parse_k3_reply
from kimi_hf.models.kimi_k3.xtml_kimi_k3 import K3_STOP_TOKEN, K3_TOKEN_OFFSETS


# the thinking-effort preamble K3's apply_chat_template prepends (thinking_effort="max" by default)
EFFORT_MAX = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in '
    "your thinking channel (not including the response channel), supported values include `low`, `medium`, "
    "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
)
EFFORT_LOW = EFFORT_MAX.replace("thinking_effort=max", "thinking_effort=low")
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
# compact, keys sorted at every level, non-ASCII kept
WEATHER_DECLARE = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
    'JSONSchema.\n\n```json\n[{"function":{"description":"Météo actuelle.","name":"get_weather","parameters":'
    '{"properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city"],"type":"object"}},'
    '"type":"function"}]\n```<|close|>message<|sep|><|end_of_msg|>'
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A tiny K3 tokenizer the way the package converts K3's tiktoken files: byte-level BPE over a few ranks,
    then K3's 256 added tokens (`<|close|>` / `<|sep|>` not special), with K3's chat markup set."""
    folder = tmp_path_factory.mktemp("k3_tok")
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b"ar", b"is", b"Par", b"Paris"]
    with open(folder / "tiktoken.model", "wb") as f:
        for rank, token in enumerate(ranks):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    n = len(ranks)
    config = {
        "added_tokens_decoder": {str(n + k): {"content": c, "special": s} for k, (c, s) in K3_TOKEN_OFFSETS.items()}
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    fast = tiktoken_to_fast(str(folder / "tiktoken.model"), str(folder / "tokenizer_config.json"))
    return use_k3_chat_markup(fast)


def render(tok, messages, **kwargs):
    kwargs.setdefault("add_generation_prompt", True)
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_one_token_table():
    """XTML's tokens are declared in xtml_kimi_k3, the document and media tokens are Kimi's (the same strings in
    chat_markup_kimi_hybrid), each at its offset in K3_TOKEN_OFFSETS; the encoder's texts reach the template from
    the chat template module's constants; the reply parser's old home still names it."""
    from kimi_hf.models.kimi_hybrid import chat_markup_kimi_hybrid as kimi
    from kimi_hf.models.kimi_k3 import chat_template_kimi_k3 as k3
    from kimi_hf.models.kimi_k3 import xtml_kimi_k3 as xtml

    assert K3_STOP_TOKEN == "<|end_of_msg|>"
    offsets = {name: off for off, (name, _) in K3_TOKEN_OFFSETS.items()}
    assert [offsets[t] for t in xtml.XTML_TOKENS] == [2, 3, 4, 5]
    assert [offsets[t] for t in xtml.K3_MEDIA_TOKENS] == [18, 19, 20, 21]
    assert set(xtml.K3_MEDIA_TOKENS) == set(kimi.KIMI_MEDIA_TOKENS) and xtml.MEDIA_PAD == kimi.IMAGE_TOKEN
    assert [offsets[t] for t in (kimi.BOS, kimi.EOS, kimi.UNK, kimi.PAD)] == [0, 1, 254, 255]
    for text in (k3.TOOL_DECLARE_HEAD, k3.DYNAMIC_TOOL_DECLARE_HEAD, *k3.THINKING_EFFORT_PREAMBLE.split("{effort}")):
        assert "'" + text.replace("\n", "\\n") + "'" in K3_CHAT_TEMPLATE
    assert "${" not in K3_CHAT_TEMPLATE
    assert k3.parse_k3_reply is parse_k3_reply and k3.K3ReplyError is K3ReplyError


def test_plain_conversation(tok):
    chat = [{"role": "user", "content": "Hello."}]
    assert render(tok, chat) == (
        EFFORT_MAX + '<|open|>message role="user"<|sep|>Hello.<|close|>message<|sep|><|end_of_msg|>' + GEN_THINK
    )
    assert render(tok, chat, add_generation_prompt=False) == (
        EFFORT_MAX + '<|open|>message role="user"<|sep|>Hello.<|close|>message<|sep|><|end_of_msg|>'
    )
    # thinking off: no preamble (whatever the effort), no think channel, the generation prompt opens the response
    user = '<|open|>message role="user"<|sep|>Hello.<|close|>message<|sep|><|end_of_msg|>'
    assert render(tok, chat, enable_thinking=False) == user + GEN_RESPONSE
    assert render(tok, chat, thinking=False, thinking_effort="high") == user + GEN_RESPONSE
    assert render(tok, chat, thinking=False, enable_thinking=True) == EFFORT_MAX + user + GEN_THINK
    # thinking_effort=None leaves the preamble out; low / high / max are accepted (reasoning_effort too)
    assert render(tok, chat, thinking_effort=None) == user + GEN_THINK
    assert render(tok, chat, thinking_effort="low") == EFFORT_LOW + user + GEN_THINK
    assert render(tok, chat, reasoning_effort="low") == EFFORT_LOW + user + GEN_THINK
    with pytest.raises(jinja2.TemplateError, match="Unsupported thinking_effort=medium"):
        render(tok, chat, thinking_effort="medium")


def test_no_bos_and_markup_tokens(tok):
    chat = [{"role": "user", "content": "hello"}]
    ids = tok.apply_chat_template(chat, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|open|>") and tok.bos_token_id not in ids
    assert ids[-1] == tok.convert_tokens_to_ids("<|sep|>")
    assert ids.count(tok.convert_tokens_to_ids("<|end_of_msg|>")) == 2
    assert k3_stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|end_of_msg|>"), tok.convert_tokens_to_ids("[EOS]")]
    # `<|close|>` and `<|sep|>` are not special: they survive skip_special_tokens, `<|open|>` does not
    assert tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).endswith(
        'message role="user"<|sep|>hello<|close|>message<|sep|>message role="assistant"<|sep|>think<|sep|>'
    )


def test_multi_turn_with_thinking(tok):
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "Thanks"},
    ]
    assert render(tok, chat) == (
        EFFORT_MAX
        + '<|open|>message role="system"<|sep|>You are terse.<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="user"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Two plus two is four.<|close|>think<|sep|>'
        + "<|open|>response<|sep|>4<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        + '<|open|>message role="user"<|sep|>Sure?<|close|>message<|sep|><|end_of_msg|>'
        # no reasoning: the think channel is still there, empty
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        + "<|open|>response<|sep|>Yes.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        + '<|open|>message role="user"<|sep|>Thanks<|close|>message<|sep|><|end_of_msg|>'
        + GEN_THINK
    )
    # thinking off: the channel is absent from the history too (the reasoning is dropped)
    assert render(tok, chat[:3], enable_thinking=False, add_generation_prompt=False) == (
        '<|open|>message role="system"<|sep|>You are terse.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>4<|close|>response<|sep|>'
        "<|close|>message<|sep|><|end_of_msg|>"
    )
    # `reasoning` is read too; whitespace-only reasoning is left out
    alias = [chat[1], {"role": "assistant", "content": "4", "reasoning": "sum"}]
    assert "<|open|>think<|sep|>sum<|close|>think<|sep|>" in render(tok, alias)
    blank = [chat[1], {"role": "assistant", "content": "4", "reasoning_content": "  \n"}]
    assert "<|open|>think<|sep|><|close|>think<|sep|>" in render(tok, blank)


def test_the_generation_prompt_is_where_the_reply_starts(tok):
    chat = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "hello", "reasoning_content": "greet"}
    for thinking in (True, False):
        prompt = render(tok, chat, enable_thinking=thinking)
        full = render(tok, chat + [reply], enable_thinking=thinking, add_generation_prompt=False)
        assert full.startswith(prompt)
        expected = "greet<|close|>think<|sep|><|open|>response<|sep|>" if thinking else ""
        expected += "hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        assert full[len(prompt) :] == expected


def test_tools_calls_and_results(tok):
    chat = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 2}},
                },
            ],
        },
        # out of order: put in the calls' order by tool_call_id, named after the call
        {"role": "tool", "tool_call_id": "b", "content": "24C"},
        {"role": "tool", "tool_call_id": "a", "name": "stale", "content": "18C"},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."},
    ]
    assert render(tok, chat, tools=[WEATHER], thinking_effort="low", add_generation_prompt=False) == (
        WEATHER_DECLARE
        + EFFORT_LOW
        + '<|open|>message role="user"<|sep|>Weather in Paris and Rome?<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Two calls.<|close|>think<|sep|>'
        + "<|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>"
        + '<|open|>call tool="get_weather" index="1"<|sep|>'
        + '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>'
        + '<|open|>call tool="get_weather" index="2"<|sep|>'
        + '<|open|>argument key="city" type="string"<|sep|>Rome<|close|>argument<|sep|>'
        + '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
        + "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        + '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>18C<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="tool" tool="get_weather" index="2"<|sep|>24C<|close|>message<|sep|><|end_of_msg|>'
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        + "<|open|>response<|sep|>Paris 18C, Rome 24C.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )


def test_argument_types_and_string_arguments(tok):
    args = {"s": "text", "n": 42, "f": 1.5, "b": True, "nul": None, "obj": {"k": "v"}, "arr": [1, "two", None]}
    chat = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "everything", "arguments": args}}]},
    ]
    body = (
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="everything" index="1"<|sep|>'
        '<|open|>argument key="s" type="string"<|sep|>text<|close|>argument<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>42<|close|>argument<|sep|>'
        '<|open|>argument key="f" type="number"<|sep|>1.5<|close|>argument<|sep|>'
        '<|open|>argument key="b" type="boolean"<|sep|>true<|close|>argument<|sep|>'
        '<|open|>argument key="nul" type="null"<|sep|>null<|close|>argument<|sep|>'
        '<|open|>argument key="obj" type="object"<|sep|>{"k": "v"}<|close|>argument<|sep|>'
        '<|open|>argument key="arr" type="array"<|sep|>[1, "two", null]<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    user = '<|open|>message role="user"<|sep|>go<|close|>message<|sep|><|end_of_msg|>'
    assert render(tok, chat, enable_thinking=False, add_generation_prompt=False) == user + body
    # OpenAI-style JSON-string arguments: the template cannot parse JSON, so they go into the json element as
    # given; normalize_k3_messages parses them first, as K3's encoder does, giving the argument form
    as_string = [chat[0], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}]
    assert (
        '<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>{"a": 1}<|close|>json<|sep|>'
        "<|close|>call<|sep|>" in render(tok, as_string)
    )
    assert (
        '<|open|>call tool="f" index="1"<|sep|><|open|>argument key="a" type="number"<|sep|>1<|close|>argument<|sep|>'
        "<|close|>call<|sep|>" in render(tok, normalize_k3_messages(as_string))
    )
    assert as_string[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the caller's messages untouched
    broken = [chat[0], {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1'}}]}]
    assert '<|open|>json type="object"<|sep|>{"a": 1<|close|>json<|sep|>' in render(tok, normalize_k3_messages(broken))
    empty = [chat[0], {"role": "assistant", "tool_calls": [{"function": {"name": "ping", "arguments": ""}}]}]
    assert '<|open|>call tool="ping" index="1"<|sep|><|close|>call<|sep|>' in render(tok, empty)


def test_tool_results_by_name_and_position(tok):
    chat = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}, {"name": "g"}]},
        {"role": "tool", "content": "one"},  # no id: named by position
        {"role": "tool", "name": "h", "content": [{"type": "text", "text": "two"}]},
    ]
    out = render(tok, chat, enable_thinking=False, add_generation_prompt=False)
    assert out.endswith(
        '<|open|>message role="tool" tool="f" index="1"<|sep|>one<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="h" index="2"<|sep|>two<|close|>message<|sep|><|end_of_msg|>'
    )
    with pytest.raises(jinja2.TemplateError, match="resolvable tool name"):
        render(tok, [{"role": "user", "content": "go"}, {"role": "tool", "content": "x"}])
    with pytest.raises(jinja2.TemplateError, match="roles system, user, assistant and tool"):
        render(tok, [{"role": "developer", "content": "x"}])


def test_images_dynamic_tools_and_request_switches(tok):
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            ],
        },
        {"role": "system", "tools": [{"type": "function", "function": {"name": "zoom"}}]},
    ]
    out = render(tok, chat, thinking_effort=None, tool_choice="none", response_format={"type": "json_object"})
    assert out == (
        '<|open|>message role="user"<|sep|><|kimi_image_placeholder|>What is this?<|kimi_image_placeholder|>'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="tool-declare"<|sep|>## New Tools Available\nThe system dynamically '
        "extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the "
        'specs for the extended tools.\n\n```json\n[{"function":{"name":"zoom"},"type":"function"}]\n```'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="tool-choice"<|sep|>The system is invoked with `tool_choice=none`.\n'
        "You MUST NOT call any tools in the next message.<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
        "`response_format=json_object`.\nYour response must be raw JSON data without markdown code blocks (```json) "
        "or any additional formatting.<|close|>message<|sep|><|end_of_msg|>" + GEN_THINK
    )
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    out = render(
        tok,
        [{"role": "user", "content": "x"}],
        thinking_effort=None,
        tool_choice="required",
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    assert out.endswith(
        "You MUST call tools in the next message.<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system" type="response-format"<|sep|>The system is invoked with '
        "`response_format=json_schema`.\nYour response must be raw JSON data without markdown code blocks (```json) "
        "or any additional formatting.\nThe JSON data must match the following schema:\n```json\n"
        '{"properties":{"a":{"type":"integer"}},"required":["a"],"type":"object"}\n```'
        "<|close|>message<|sep|><|end_of_msg|>" + GEN_THINK
    )


def test_attribute_escaping(tok):
    chat = [
        {"role": "system", "content": 'Rules & "quotes" stay raw in content.', "name": "policy"},
        {"role": "user", "content": "hi", "name": 'He said "hi" & <left>'},
        {
            "role": "assistant",
            "content": "ok",
            "name": "bot",
            "tool_calls": [{"name": 'a"b&c', "arguments": {"k&": 1}}],
        },
    ]
    assert render(tok, chat, thinking_effort=None, add_generation_prompt=False) == (
        '<|open|>message role="system" name="policy"<|sep|>Rules & "quotes" stay raw in content.'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user" name="He said &quot;hi&quot; &amp; <left>"<|sep|>hi'
        "<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="assistant" name="bot"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        "<|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="a&quot;b&amp;c" index="1"<|sep|><|open|>argument key="k&amp;" type="number"<|sep|>1'
        "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    reply = parse_k3_reply(
        '<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="a&quot;b&amp;c" '
        'index="1"<|sep|><|open|>argument key="&amp;quot;" type="string"<|sep|>v<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|>"
    )
    assert reply["tool_calls"] == [{"type": "function", "function": {"name": 'a"b&c', "arguments": {"&quot;": "v"}}}]


REPLIES = [
    {"role": "assistant", "reasoning_content": "15% of 240: 0.15 * 240 = 36.", "content": "15% of 240 is 36."},
    {"role": "assistant", "reasoning_content": "", "content": 'Hi!\n  Two lines, <b>raw</b> & "quoted".\n'},
    {
        "role": "assistant",
        "reasoning_content": "Need the weather.",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
            {
                "type": "function",
                "function": {"name": "log", "arguments": {"ok": False, "x": None, "tags": ["a", 1], "m": {"k": 1.5}}},
            },
            {"type": "function", "function": {"name": "ping", "arguments": {}}},
        ],
    },
]


@pytest.mark.parametrize("index", range(len(REPLIES)))
@pytest.mark.parametrize("thinking", [True, False])
def test_render_parse_round_trip(tok, index, thinking):
    chat = [{"role": "user", "content": "What is 15% of 240?"}]
    message = dict(REPLIES[index])
    if not thinking:
        message["reasoning_content"] = None
    prompt = render(tok, chat, tools=[WEATHER], enable_thinking=thinking)
    full = render(tok, chat + [message], tools=[WEATHER], enable_thinking=thinking, add_generation_prompt=False)
    reply = full[len(prompt) :]
    # through token ids, as generate() returns it, then a batch's padding / a next turn after the stop token
    ids = tok(reply, add_special_tokens=False)["input_ids"]
    decoded = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded == reply
    generated = decoded + "[PAD][PAD]" + GEN_THINK + "more"
    parsed = parse_k3_reply(generated, prefix=prompt)
    expected = {"role": "assistant", "reasoning_content": None, "content": "", "tool_calls": [], **message}
    assert parsed == expected
    again = render(tok, chat + [parsed], tools=[WEATHER], enable_thinking=thinking, add_generation_prompt=False)
    assert again == full
    # transformers' parse_response with K3_RESPONSE_TEMPLATE: arguments cast by the tools' schemas
    via_hf = tok.parse_response(generated, prefix=prompt, tools=[WEATHER])
    # content always (maybe empty); reasoning and tool calls only when the reply has them
    want = {k: v for k, v in expected.items() if k == "content" or v not in (None, "", [])}
    if "tool_calls" in want:  # without the `type` attribute: strings, unless the tool's schema types them
        want["tool_calls"] = [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
            {
                "type": "function",
                "function": {
                    "name": "log",
                    "arguments": {"ok": "false", "x": "null", "tags": '["a", 1]', "m": '{"k": 1.5}'},
                },
            },
            {"type": "function", "function": {"name": "ping", "arguments": {}}},
        ]
    assert via_hf == want


def test_parse_without_prefix(tok):
    # the think channel's continuation, a whole message, a response continuation, a plain string
    assert parse_k3_reply("R<|close|>think<|sep|><|open|>response<|sep|>A<|close|>response<|sep|>") == {
        "role": "assistant",
        "reasoning_content": "R",
        "content": "A",
        "tool_calls": [],
    }
    whole = GEN_THINK + "R<|close|>think<|sep|><|open|>response<|sep|>A<|close|>response<|sep|><|close|>message<|sep|>"
    assert parse_k3_reply(whole)["content"] == "A" and parse_k3_reply(whole)["reasoning_content"] == "R"
    assert parse_k3_reply("A<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")["content"] == "A"
    assert parse_k3_reply("just text") == {
        "role": "assistant",
        "reasoning_content": None,
        "content": "just text",
        "tool_calls": [],
    }
    # cut short by max_new_tokens inside a channel: the text so far, not an error
    assert parse_k3_reply("still thinking", prefix=GEN_THINK)["reasoning_content"] == "still thinking"
    assert parse_k3_reply("R<|close|>think<|sep|><|open|>response<|sep|>Par")["content"] == "Par"
    # the reply's json-element form of a call
    call = '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>{"a": [1]}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    assert parse_k3_reply(call, prefix=GEN_RESPONSE)["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": [1]}}}
    ]
    with pytest.raises(TypeError):
        parse_k3_reply([1, 2, 3])


MALFORMED = [
    ("R<|close|>think<|sep|><|open|>bogus<|sep|>x", "unexpected <bogus> element"),
    ("R<|close|>think<|sep|>stray<|open|>response<|sep|>A<|close|>response<|sep|>", "text outside"),
    ("R<|close|>response<|sep|>", "expected <|close|>think<|sep|>"),
    ("R<|close|>think<|sep|><|open|>response<|sep|>A<|close|>response<|sep|><|open|>response<|sep|>B", "second"),
    (
        'R<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f"<|sep|><|open|>argument key="n" type="number"'
        "<|sep|>abc<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        "argument 'n'",
    ),
    (
        'R<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f"<|sep|><|open|>json type="object"<|sep|>[1]'
        "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>",
        "not a JSON object",
    ),
    ('R<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="f"<|sep|><|open|>argument key="a"', "unterminated"),
    ("R<|close|>think<|sep|><|open|>tools<|sep|><|open|>call<|sep|><|close|>call<|sep|>", "without a tool name"),
    ('R<|close|>think<|sep|><|open|>response bad="<|sep|>', "malformed element header"),
]


@pytest.mark.parametrize("text,message", MALFORMED)
def test_malformed_replies(text, message):
    with pytest.raises(K3ReplyError, match=message) as error:
        parse_k3_reply(text, prefix=GEN_THINK)
    assert isinstance(error.value, ValueError) and "at position" in str(error.value)
    lenient = parse_k3_reply(text, prefix=GEN_THINK, strict=False)
    # what parsed, then the unparsed rest (from the start of the element that failed) as plain text
    rest = error.value.text[error.value.resume :]
    assert rest and lenient["content"].endswith(rest) and rest in text
    assert lenient["reasoning_content"] == (None if text.startswith("R<|close|>response") else "R")


def test_lenient_keeps_what_parsed():
    text = (
        'R<|close|>think<|sep|><|open|>response<|sep|>A<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="f"'
        '<|sep|><|close|>call<|sep|><|open|>call tool="g"<|sep|><|open|>argument key="x" type="number"<|sep|>'
    )
    out = parse_k3_reply(text, prefix=GEN_THINK, strict=False)
    assert out["content"] == 'A<|open|>call tool="g"<|sep|><|open|>argument key="x" type="number"<|sep|>'
    assert out["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    assert out["reasoning_content"] == "R"
    with pytest.raises(K3ReplyError, match="unterminated argument element"):
        parse_k3_reply(text, prefix=GEN_THINK)


def test_random_markup_never_crashes():
    pieces = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "think", "response", "tools", "call", "json",
              "argument", ' tool="f"', ' key="k"', ' type="number"', ' type="object"', "1", "{", "}", "x", " ", '"']  # fmt: skip
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        prefix = rng.choice([None, GEN_THINK, GEN_RESPONSE, ""])
        try:
            parse_k3_reply(text, prefix=prefix)
        except K3ReplyError:
            pass
        out = parse_k3_reply(text, prefix=prefix, strict=False)
        assert set(out) == {"role", "reasoning_content", "content", "tool_calls"}


def test_assistant_tokens_mask_marks_exactly_the_replies(tok):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Paris", "reasoning_content": "hell"},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18C"},
        {"role": "assistant", "content": "18C."},
    ]
    for thinking, expected in (
        (
            True,
            "hell<|close|>think<|sep|><|open|>response<|sep|>Paris<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
            "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
            '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
            "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
            "<|close|>think<|sep|><|open|>response<|sep|>18C.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
        ),
        (
            False,
            "Paris<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
            '<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>'
            "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
            "18C.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
        ),
    ):
        enc = tok.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, enable_thinking=thinking
        )
        ids, mask = enc["input_ids"], enc["assistant_masks"]
        trained = tok.decode([i for i, m in zip(ids, mask) if m], clean_up_tokenization_spaces=False)
        assert trained == expected
        # three runs of ones, each starting right after the generation prompt's tokens
        starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        header = tok(GEN_THINK if thinking else GEN_RESPONSE, add_special_tokens=False)["input_ids"]
        assert len(starts) == 3 and all(ids[s - len(header) : s] == header for s in starts)


def test_saved_tokenizer_keeps_the_markup(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == K3_CHAT_TEMPLATE and loaded.response_template == K3_RESPONSE_TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    assert render(loaded, chat) == render(tok, chat)


def test_the_default_thinking_effort_of_a_saved_template():
    """k3_chat_template(effort): what a prompt gets without thinking_effort=. K3's own default is "max"; a model
    trained without the preamble (the quickstart's) saves a template whose default leaves it out."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import K3_CHAT_TEMPLATE, k3_chat_template

    chat = [[{"role": "user", "content": "Hello"}]]

    def render(template, **kwargs):
        return render_jinja_template(chat, chat_template=template, add_generation_prompt=True, **kwargs)[0][0]

    assert K3_CHAT_TEMPLATE == k3_chat_template("max")
    assert "thinking_effort=max" in render(K3_CHAT_TEMPLATE)
    assert render(k3_chat_template(None)) == render(K3_CHAT_TEMPLATE, thinking_effort=None)
    assert "thinking_effort=low" in render(k3_chat_template("low"))
    assert "thinking_effort=high" in render(k3_chat_template(None), thinking_effort="high")  # still per call
    with pytest.raises(ValueError, match="default_thinking_effort"):
        k3_chat_template("medium")
