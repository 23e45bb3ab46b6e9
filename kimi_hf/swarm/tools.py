"""Tool calls: the swarm's two orchestrator tools, user tools from Python functions, and parsing.

A tool call is parsed from generated text with transformers' own parser when the tokenizer carries a
`response_template` (`tokenizer.parse_response`), else from Kimi K3's XTML markup
(<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>...<|close|>call<|sep|><|close|>tools<|sep|>, read by
`parse_k3_reply`), Kimi K2's markup
(<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>) or the
common <tool_call>{"name": ..., "arguments": {...}}</tool_call> form. `format_tool_calls` writes K2's markup
(rendered by Kimi's chat template) or, with markup="k3", the reply a K3 model writes (rendered by K3's).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema

from ..models.kimi_hybrid.chat_markup_kimi_hybrid import (
    TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TURN_END,
    render_kimi_reply,
)
from ..models.kimi_k3.chat_template_kimi_k3 import render_k3_reply
from ..models.kimi_k3.reply_parser_kimi_k3 import parse_k3_reply
from ..models.kimi_k3.xtml_kimi_k3 import CLOSE, OPEN


CREATE_SUBAGENT = {
    "type": "function",
    "function": {
        "name": "create_subagent",
        "description": "Create a sub-agent: a worker with its own context that runs tasks you assign to it "
        "and returns only its final answer.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "A unique name for the sub-agent."},
                "system_prompt": {"type": "string", "description": "Its role and instructions."},
            },
            "required": ["name"],
        },
    },
}
ASSIGN_TASK = {
    "type": "function",
    "function": {
        "name": "assign_task",
        "description": "Give a created sub-agent a task. Tasks assigned in the same turn run in parallel; "
        "each returns the sub-agent's final answer.",
        "parameters": {
            "type": "object",
            "properties": {
                "agent": {"type": "string", "description": "The sub-agent's name."},
                "task": {"type": "string", "description": "What it should do, self-contained."},
            },
            "required": ["agent", "task"],
        },
    },
}
ORCHESTRATOR_TOOLS = [CREATE_SUBAGENT, ASSIGN_TASK]

_KIMI_CALL = re.compile(
    re.escape(TOOL_CALL_BEGIN)
    + r"\s*(?P<id>[^<]*?)\s*"
    + re.escape(TOOL_CALL_ARGUMENT_BEGIN)
    + r"(?P<args>.*?)"
    + re.escape(TOOL_CALL_END),
    re.DOTALL,
)
_HERMES_CALL = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    """One call: `arguments` is a dict, or the raw string when it was not valid JSON (reported back)."""

    name: str
    arguments: dict | str
    id: str = ""

    def to_message(self) -> dict:
        """The OpenAI / transformers chat format of the call (arguments as a dict)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _kimi_name(call_id: str) -> str:
    """functions.NAME:IDX -> NAME."""
    name = call_id.split(":")[0]
    return name[len("functions.") :] if name.startswith("functions.") else name


def _loads(raw: str) -> dict | str:
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return raw
    return value if isinstance(value, dict) else raw


def parse_tool_calls(
    text: str, tokenizer=None, prefix: str | None = None, tools: list | None = None
) -> tuple[str, list[ToolCall]]:
    """Generated text -> (content without the call markup, tool calls in order)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        try:
            message = tokenizer.parse_response(text, prefix=prefix or "", tools=tools)
        except Exception:  # malformed markup (e.g. arguments that are not JSON): the lenient parser below
            message = None
        if message is not None:
            calls = []
            for i, c in enumerate(message.get("tool_calls") or []):
                fn = c.get("function", c)
                args = fn.get("arguments", {})
                calls.append(
                    ToolCall(
                        fn["name"],
                        _loads(args) if isinstance(args, str) else args,
                        c.get("id") or f"functions.{fn['name']}:{i}",
                    )
                )
            return (message.get("content") or "").strip(), calls
    if OPEN in text or CLOSE in text:  # K3's XTML markup (read leniently: malformed markup stays content)
        message = parse_k3_reply(text, prefix=prefix, strict=False)
        calls = [
            ToolCall(c["function"]["name"], c["function"]["arguments"], f"functions.{c['function']['name']}:{i}")
            for i, c in enumerate(message.get("tool_calls") or [])
        ]
        return (message.get("content") or "").strip(), calls
    calls = []
    for i, m in enumerate(_KIMI_CALL.finditer(text)):
        call_id = m["id"].strip() or f"call_{i}"
        calls.append(ToolCall(_kimi_name(call_id), _loads(m["args"].strip()), call_id))
    content = text.split(TOOL_CALLS_BEGIN)[0] if calls else text
    if not calls:
        for i, m in enumerate(_HERMES_CALL.finditer(text)):
            body = _loads(m["body"])
            if isinstance(body, dict) and isinstance(body.get("name"), str):
                args = body.get("arguments", body.get("parameters", {}))
                calls.append(ToolCall(body["name"], _loads(args) if isinstance(args, str) else args, f"call_{i}"))
            else:
                calls.append(ToolCall("<unparsed>", m["body"], f"call_{i}"))
        if calls:
            content = _HERMES_CALL.sub("", text)
    return content.strip(), calls


def format_tool_calls(calls: list[tuple[str, dict]] | list[ToolCall], content: str = "", markup: str = "kimi") -> str:
    """Text in Kimi's tool-call markup (what the chat template renders and the parser reads), for
    scripted agents and for replaying messages: [(name, arguments), ...] or ToolCalls. markup="kimi": K2's
    markup after `content`; "k3": the whole reply a K3 model writes after its generation prompt (think channel
    closed, `content` in the response channel, the calls, `<|end_of_msg|>`)."""
    pairs = [(c.name, c.arguments) if isinstance(c, ToolCall) else tuple(c) for c in calls]
    if markup == "k3":
        return render_k3_reply(content, [_openai_call(name, args) for name, args in pairs])
    if markup != "kimi":
        raise ValueError(f"markup must be 'kimi' or 'k3', got {markup!r}")
    # Kimi's chat template writes the calls (ids functions.NAME:IDX, as none is given); dict arguments go in as
    # json.dumps' text (ASCII-escaped, as this function has always written them), not the template's tojson
    calls = [_openai_call(name, args if isinstance(args, str) else json.dumps(args)) for name, args in pairs]
    return render_kimi_reply(content, calls).removesuffix(TURN_END)  # up to the turn's end, which it leaves out


def _openai_call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class Tool:
    """A Python function the agents may call: its JSON schema comes from the signature and the
    Google-style docstring (transformers' get_json_schema). Async functions are awaited."""

    fn: Callable
    schema: dict = field(default_factory=dict)

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"tool must be callable, got {type(self.fn).__name__}")
        self.schema = self.schema or get_json_schema(self.fn)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    async def __call__(self, arguments: dict) -> Any:
        result = self.fn(**arguments)
        return await result if inspect.isawaitable(result) else result


def as_tools(tools) -> dict[str, Tool]:
    """A list of functions / Tool objects -> {name: Tool}; duplicate names raise ValueError."""
    out: dict[str, Tool] = {}
    for t in tools or []:
        tool = t if isinstance(t, Tool) else Tool(t)
        if tool.name in out:
            raise ValueError(f"tools: two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


__all__ = [
    "ToolCall",
    "Tool",
    "as_tools",
    "parse_tool_calls",
    "format_tool_calls",
    "ORCHESTRATOR_TOOLS",
    "CREATE_SUBAGENT",
    "ASSIGN_TASK",
]
