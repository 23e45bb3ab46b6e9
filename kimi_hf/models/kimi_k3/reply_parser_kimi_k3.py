"""A parser for Kimi K3's replies (XTML, the markup of chat_template_kimi_k3.py): the text a K3 model writes after its
generation prompt -> the assistant message it stands for, {"role", "reasoning_content", "content", "tool_calls"}.

Rendering is chat_template_kimi_k3's (K3_CHAT_TEMPLATE, `render_k3_reply`), and so is transformers' own parser spec
for the markup (K3_RESPONSE_TEMPLATE, which `tokenizer.parse_response` reads with fewer guarantees): this module
reads what they write back, element by element, with typed tool-call arguments and errors that name the place.

    reply = tokenizer.decode(new_ids, skip_special_tokens=False)   # <|open|> and <|end_of_msg|> are special
    parse_k3_reply(reply, prefix=prompt)    # {"role": "assistant", "reasoning_content", "content", "tool_calls"}

Part of the flat, Hub-copyable model folder: imports only the standard library and the token table (xtml_kimi_k3.py).
chat_template_kimi_k3 re-exports `parse_k3_reply` and `K3ReplyError` (their home before this module).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..kimi_hybrid.chat_markup_kimi_hybrid import EOS
from .xtml_kimi_k3 import (
    CLOSE,
    END_OF_MSG,
    MESSAGE_CLOSE,
    OPEN,
    RESPONSE_OPEN,
    SEP,
    THINK_CLOSE,
    THINK_OPEN,
)


class K3ReplyError(ValueError):
    """A reply whose XTML does not parse. `position`: where, in `text` (what the parser saw: the channel the
    prefix opened, then the reply); `partial`: what parsed before it; `resume`: where the unparsed rest starts
    (the start of the element that failed)."""

    def __init__(self, reason: str, partial: dict, position: int, text: str, resume: int | None = None):
        super().__init__(f"{reason} at position {position} of {text[max(0, position - 40) : position + 40]!r}")
        self.reason, self.partial, self.position, self.text = reason, partial, position, text
        self.resume = position if resume is None else resume


# the markup's tokens (xtml_kimi_k3's table), escaped: a reply is read token by token between them
_MARKUP = re.compile("|".join(re.escape(token) for token in (OPEN, CLOSE, SEP, END_OF_MSG)))
_HEADER = re.compile(r'\s*([A-Za-z_][\w-]*)((?:\s+[A-Za-z_][\w-]*="[^"]*")*)\s*\Z')
_ATTR = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')
_ENTITY = re.compile(r"&(amp|quot);")
# an assistant message's header, with any attributes (a `name`): ASSISTANT_HEADER is the one without
_ASSISTANT_HEADER = re.compile(re.escape(OPEN) + 'message role="assistant"[^<]*' + re.escape(SEP))


def unescape_attr(value: str) -> str:
    """Inverse of the encoder's attribute escaping (`&` -> `&amp;`, then `"` -> `&quot;`)."""
    return _ENTITY.sub(lambda m: "&" if m.group(1) == "amp" else '"', value)


def _argument_value(raw: str, kind: str | None) -> Any:
    """An `argument` element's text -> its value, by its `type` attribute (the encoder writes strings raw and
    everything else as JSON). A missing type reads as a string."""
    if kind in (None, "string"):
        return raw
    if kind not in ("number", "boolean", "null", "object", "array"):
        raise ValueError(f"unknown argument type {kind!r}")
    value = json.loads(raw.strip())
    expected = {
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }[kind]
    if not expected(value):
        raise ValueError(f"{raw!r} is not a JSON {kind}")
    return value


class _ReplyParser:
    """Recursive descent over one assistant message body: [think] [response] [tools], then the message's end."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0
        self.out = {"role": "assistant", "reasoning_content": None, "content": "", "tool_calls": []}

    def fail(self, reason: str, position: int | None = None, resume: int | None = None):
        position = self.pos if position is None else position
        raise K3ReplyError(reason, self.out, position, self.text, resume)

    def skip_space(self):
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def at(self, literal: str) -> bool:
        return self.text.startswith(literal, self.pos)

    def open_tag(self) -> tuple[str, dict]:
        """At `<|open|>`: reads `tag attr="..."<|sep|>` -> (tag, attributes, unescaped)."""
        start = self.pos
        self.pos += len(OPEN)
        m = _MARKUP.search(self.text, self.pos)
        if m is None or m.group() != SEP:
            self.fail("unterminated element header" if m is None else f"{m.group()} inside an element header", start)
        header = _HEADER.match(self.text, self.pos, m.start())
        if header is None:
            self.fail(f"malformed element header {self.text[self.pos : m.start()]!r}", start)
        self.pos = m.end()
        return header.group(1), {k: unescape_attr(v) for k, v in _ATTR.findall(header.group(2))}

    def body(self, tag: str, *, may_end: bool) -> str:
        """Text up to `<|close|>tag<|sep|>` (consumed). `may_end`: a missing close at the end of the text is a
        truncated reply (generation stopped by length), not an error."""
        m = _MARKUP.search(self.text, self.pos)
        start = self.pos
        if m is None:
            if not may_end:
                self.fail(f"unterminated {tag} element", len(self.text), start)
            self.pos = len(self.text)
            return self.text[start:]
        if not self.text.startswith(CLOSE + tag + SEP, m.start()):
            # resumed at the body's start, so that strict=False keeps the body's text in the plain reply
            self.fail(f"expected {CLOSE}{tag}{SEP}, got {self.text[m.start() : m.start() + 30]!r}", m.start(), start)
        self.pos = m.start() + len(CLOSE + tag + SEP)
        return self.text[start : m.start()]

    def call(self, attrs: dict) -> dict:
        if not attrs.get("tool"):
            self.fail("a call without a tool name")
        arguments: dict = {}
        while True:
            self.skip_space()
            if self.at(CLOSE + "call" + SEP):
                self.pos += len(CLOSE + "call" + SEP)
                return {"type": "function", "function": {"name": attrs["tool"], "arguments": arguments}}
            if not self.at(OPEN):
                self.fail("expected an argument, a json element or the end of the call")
            start = self.pos
            tag, element = self.open_tag()
            if tag == "argument":
                if "key" not in element:
                    self.fail("an argument without a key", start)
                raw = self.body("argument", may_end=False)
                try:
                    arguments[element["key"]] = _argument_value(raw, element.get("type"))
                except ValueError as e:
                    self.fail(f"argument {element['key']!r}: {e}", start)
            elif tag == "json":
                raw = self.body("json", may_end=False)
                try:
                    value = json.loads(raw)
                except ValueError as e:
                    self.fail(f"the call's json element is not JSON ({e})", start)
                if not isinstance(value, dict):
                    self.fail("the call's json element is not a JSON object", start)
                arguments.update(value)
            else:
                self.fail(f"unexpected <{tag}> element in a call", start)

    def tools(self):
        while True:
            self.skip_space()
            if self.at(CLOSE + "tools" + SEP):
                self.pos += len(CLOSE + "tools" + SEP)
                return
            if not self.at(OPEN):
                self.fail("expected a call or the end of the tools element")
            start = self.pos
            tag, attrs = self.open_tag()
            if tag != "call":
                self.fail(f"unexpected <{tag}> element in tools", start)
            try:
                self.out["tool_calls"].append(self.call(attrs))
            except K3ReplyError as error:  # a broken call is dropped whole (strict=False: its text is the rest)
                self.fail(error.reason, error.position, start)

    def parse(self) -> dict:
        seen = set()
        while True:
            self.skip_space()
            if self.pos >= len(self.text) or self.at(MESSAGE_CLOSE):
                return self.out
            if not self.at(OPEN):
                self.fail("text outside the think / response / tools elements")
            start = self.pos
            tag, _ = self.open_tag()
            if tag in seen or tag not in ("think", "response", "tools"):
                self.fail(f"unexpected {'second ' if tag in seen else ''}<{tag}> element", start)
            seen.add(tag)
            if tag == "think":
                self.out["reasoning_content"] = self.body("think", may_end=True)
            elif tag == "response":
                self.out["content"] = self.body("response", may_end=True)
            else:
                self.tools()


def parse_k3_reply(text: str, prefix: str | None = None, *, strict: bool = True) -> dict:
    """A K3 reply (decoded with `skip_special_tokens=False`: `<|open|>` and `<|end_of_msg|>` are special) ->
    {"role": "assistant", "reasoning_content": str | None, "content": str, "tool_calls": [...]}, the message
    to append to the chat (`apply_chat_template` renders it back as the model wrote it). Tool calls are
    {"type": "function", "function": {"name", "arguments": dict}}, argument values typed by their `type`
    attribute. `reasoning_content` is None when the reply has no think channel (thinking off).

    `prefix`: the prompt the reply continues (it ends inside the channel the generation prompt opened). Without
    one, a reply that does not start with an element is read as continuing the think channel when it closes
    one, else the response channel (a plain string is a plain reply). The reply ends at the message's end,
    `<|end_of_msg|>` or `[EOS]`; what follows is ignored. A channel cut short (max_new_tokens) keeps its text.
    Malformed markup raises `K3ReplyError` (a ValueError) naming the place; with `strict=False` the parsed
    part is returned instead, the unparsed rest (markup included) appended to `content`."""
    if not isinstance(text, str):
        raise TypeError(f"parse_k3_reply takes the decoded reply text, got {type(text).__name__}")
    head = None
    if prefix:
        anchors = list(_ASSISTANT_HEADER.finditer(prefix))
        if anchors:
            head = prefix[anchors[-1].end() :]
    m = _ASSISTANT_HEADER.match(text.lstrip())
    if m is not None:  # a whole message
        text, head = text.lstrip()[m.end() :], ""
    if head is None:  # where does the reply start? (no prefix says)
        if text.lstrip().startswith(OPEN):
            head = ""
        elif THINK_CLOSE in text.split(END_OF_MSG)[0].split(EOS)[0]:
            head = THINK_OPEN
        else:
            head = RESPONSE_OPEN
    full = head + text
    ends = [i for i in (full.find(END_OF_MSG, len(head)), full.find(EOS, len(head))) if i >= 0]
    full = full[: min(ends)] if ends else full
    parser = _ReplyParser(full)
    try:
        return parser.parse()
    except K3ReplyError as error:
        if strict:
            raise
        out = error.partial
        rest = full[max(error.resume, len(head)) :].split(MESSAGE_CLOSE)[0]
        out["content"] = (out["content"] or "") + rest
        return out


__all__ = ["K3ReplyError", "parse_k3_reply", "unescape_attr"]
