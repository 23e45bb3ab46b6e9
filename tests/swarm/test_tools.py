"""Tool-call markup: Kimi's format through the chat template and back, the <tool_call> form, schemas."""

import json

import pytest

from kimi_hf.models.kimi_hybrid.chat_markup_kimi_hybrid import TURN_END, render_kimi_reply
from kimi_hf.swarm import ORCHESTRATOR_TOOLS, Tool, ToolCall, as_tools, format_tool_calls, parse_tool_calls

from ..models.kimi_hybrid.helpers import tiny_tokenizer


def test_kimi_markup_round_trip():
    text = format_tool_calls(
        [("assign_task", {"agent": "a", "task": "x"}), ("create_subagent", {"name": "b"})], "plan: "
    )
    content, calls = parse_tool_calls(text + "<|im_end|>")
    assert content == "plan:"
    assert [(c.name, c.arguments, c.id) for c in calls] == [
        ("assign_task", {"agent": "a", "task": "x"}, "functions.assign_task:0"),
        ("create_subagent", {"name": "b"}, "functions.create_subagent:1"),
    ]


def test_kimi_markup_is_what_the_chat_template_writes():
    # the chat template's tool-call format, short of the turn's end; dict arguments as json.dumps writes them
    text = format_tool_calls([("f", {"city": "Zürich"}), ("g", '{"raw": 1}')], "ok")
    assert text == (
        "ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"city": "Z\\u00fcrich"}<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>'
        '{"raw": 1}<|tool_call_end|><|tool_calls_section_end|>'
    )
    calls = [
        {"function": {"name": "f", "arguments": json.dumps({"city": "Zürich"})}},
        {"name": "g", "arguments": '{"raw": 1}'},
    ]
    assert text + TURN_END == render_kimi_reply("ok", calls)
    assert format_tool_calls([], "just text") == "just text"


def test_hermes_form_and_malformed_arguments():
    content, calls = parse_tool_calls(
        'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    assert content == "ok" and [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {"y": 2})]
    _, calls = parse_tool_calls(format_tool_calls([("f", "{not json")]))
    assert calls[0].arguments == "{not json"
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    with pytest.raises(TypeError, match="text"):
        parse_tool_calls(None)


def test_chat_template_renders_tools_calls_and_results():
    tok = tiny_tokenizer()
    calls = [ToolCall("create_subagent", {"name": "a"}, "functions.create_subagent:0")]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [c.to_message() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "name": "create_subagent", "content": "Created."},
    ]
    text = tok.apply_chat_template(messages, tools=ORCHESTRATOR_TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>[{")
    assert '"name": "assign_task"' in text or '"name":"assign_task"' in text
    assert format_tool_calls(calls) in text  # what the parser reads is what the template writes
    assert "<|im_system|>tool<|im_middle|>## Return of functions.create_subagent:0\nCreated.<|im_end|>" in text
    assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
    # the tool tokens are single special tokens of the trained tokenizer
    ids = tok("<|tool_call_begin|>", add_special_tokens=False)["input_ids"]
    assert len(ids) == 1


def test_tool_schema_from_function():
    def search(query: str, limit: int = 3) -> str:
        """Searches the documents.

        Args:
            query: words to look for.
            limit: at most this many hits.
        """
        return query * limit

    tools = as_tools([search])
    assert tools["search"].schema["function"]["parameters"]["required"] == ["query"]
    with pytest.raises(ValueError, match="two tools"):
        as_tools([search, Tool(search)])
    with pytest.raises(TypeError, match="callable"):
        Tool(3)
