"""Kimi K3's chat markup ("XTML"), in one place: its tokens, a Jinja chat template that stock
`tokenizer.apply_chat_template` renders as K3's own Python encoder (`encoding_k3.py`, `build_chat_segments`)
does, transformers' response parser spec for it, the rendering of a reply, and the stop token. The parser for the
model's replies is reply_parser_kimi_k3.py (`parse_k3_reply`).

K3 ships no Jinja template; its tokenizer builds the prompt in Python. The markup is XML-like, its brackets
being tokens (`<|open|>` special; `<|close|>` and `<|sep|>` not special, so they survive
`skip_special_tokens`), and every message ends with `<|end_of_msg|>` (the model's stop token):

    <|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides ...
        Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>What is 15% of 240?<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>think<|sep|>                  <- the generation prompt
        0.15 * 240 = 36<|close|>think<|sep|><|open|>response<|sep|>36<|close|>response<|sep|>
        <|close|>message<|sep|><|end_of_msg|>                                   <- what the model writes

(one line in reality: there is no whitespace between elements). With tools, a `tool-declare` system message
(compact, key-sorted JSON Schema) comes first; an assistant's calls follow its response channel as
`<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city"
type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>`; results are
`<|open|>message role="tool" tool="get_weather" index="1"<|sep|>18C<|close|>message<|sep|><|end_of_msg|>`.
An image is the text `<|kimi_image_placeholder|>` (not a token: the processor replaces it with
`<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`). No BOS is written.

Choices made where the sources (public ports of encoding_k3.py: vLLM's copy "derived from encoding_k3.py at
commit c5d1dd4", a port differential-tested against the release's encoding_k3.py, llama.cpp's Kimi-K3.jinja,
ms-swift's K3 template tests against the official tokenizer) are silent or disagree:

- Attribute values escape `&` -> `&amp;` then `"` -> `&quot;`; `<` and `>` stay literal (all ports agree:
  the markup's brackets are tokens, not characters). Message content is never escaped.
- Thinking: on by default (K3's `thinking=True`). The template reads `enable_thinking` (transformers'
  convention) and K3's own name `thinking`; `enable_thinking` wins when both are given. Thinking effort:
  `thinking_effort` (alias `reasoning_effort`), default "max" as K3's `apply_chat_template` does
  (`kwargs.setdefault("thinking_effort", "max")`); `thinking_effort=None` leaves the preamble out. Accepted
  values low / high / max, as the encoder asserts (its own preamble text also names `medium`, which the
  encoder rejects; llama.cpp's template accepts it; we follow the encoder).
- Every assistant message carries the think channel when thinking is on, empty when it has no reasoning
  (history reasoning is kept, not stripped: encoder ports, llama.cpp and ms-swift agree; one tinker renderer
  strips it, which we do not follow). With thinking off the channel is absent. Reasoning that is only
  whitespace is left out, as the encoder does.
- The generation prompt opens the assistant message and the think channel (`response` with thinking off):
  the model's reply starts inside the channel (the Megatron-Bridge greedy run of the real model continues
  with `...<|close|>think<|sep|><|open|>response<|sep|>15% of 240 is 36.`).
- Assistant tool calls: dict arguments are rendered as typed `argument` elements (string values raw, other
  values as JSON with json.dumps' default separators), which is what the encoder does. The `json type="object"`
  element is the encoder's form for arguments that are a string it cannot parse as JSON. A Jinja template
  cannot parse JSON, so arguments given as a JSON *string* are rendered in the `json` element as they are;
  call `normalize_k3_messages` first (it parses them, as the encoder does) to get the encoder's bytes.
- Tool results: named by `tool` / `name`, else by the position of the preceding assistant's call; a run of
  results that all name a call by `tool_call_id` is put in the calls' order and takes the call's name (the
  encoder's `normalize_xtml_tool_result_messages`); `index` counts results since the last assistant message.
- `name` attributes on system / user / assistant messages when the message has a `name` (the
  differential-tested port and llama.cpp; vLLM's copy drops it for assistants).
- A message with an unknown role raises (the encoder skips it silently).
- `tool_choice` ("required" / "none") and `response_format` (json_object / json_schema) add the encoder's
  internal system messages after the conversation. `image_prompts` (the processor's expansion) is not done
  here: images stay `<|kimi_image_placeholder|>`.
- Tokens: the encoder tokenizes its segments one by one and encodes content with special tokens disallowed;
  `apply_chat_template` tokenizes the whole string, so content that spells a markup token (`<|open|>`)
  becomes that token, and a BPE merge across a segment boundary could differ (none does for K3's split
  pattern at the markup's boundaries). The rendered *string* is the encoder's.
- `{% generation %}` marks what the model writes after the generation prompt: for each assistant message,
  everything after `<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` (or `...<|open|>response<|sep|>`
  with thinking off) up to and including its `<|end_of_msg|>`, so `return_assistant_tokens_mask` and TRL's
  `assistant_only_loss` train on exactly the reply.

Its tokens and elements are the token table of xtml_kimi_k3.py. Part of the flat, Hub-copyable model folder: imports
only the standard library, transformers and model-folder modules.
"""

from __future__ import annotations

import json
import re
from string import Template

from ..kimi_hybrid.chat_markup_kimi_hybrid import EOS
from .reply_parser_kimi_k3 import K3ReplyError, parse_k3_reply
from .xtml_kimi_k3 import (
    ASSISTANT_HEADER,
    CLOSE,
    END_OF_MSG,
    GENERATION_PROMPT,
    IMAGE_PLACEHOLDER,
    K3_STOP_TOKEN,
    MESSAGE_CLOSE,
    OPEN,
    RESPONSE_CLOSE,
    RESPONSE_OPEN,
    SEP,
    THINK_CLOSE,
    THINK_OPEN,
)


# The encoder's texts that K3_CHAT_TEMPLATE writes (built from these, below): the thinking efforts it accepts and
# its default, the thinking-effort preamble ({effort}: the effort), the heads of the tool declarations.
VALID_THINKING_EFFORTS = ("low", "high", "max")
DEFAULT_THINKING_EFFORT = "max"
THINKING_EFFORT_PREAMBLE = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
TOOL_DECLARE_HEAD = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
DYNAMIC_TOOL_DECLARE_HEAD = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
)


def _jinja_text(text: str) -> str:
    """`text` as the inside of a single-quoted Jinja string literal (backslash, quote and newline escaped)."""
    return text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")


# Every piece of output is an expression (`{{- ... -}}`) and every tag strips the whitespace around it, so
# the template's own layout never reaches the prompt. `\n` inside the string literals is Jinja's escape. `${NAME}`
# (string.Template: Jinja has no `$`) is one of the strings above, written into a Jinja string literal by
# `_jinja_text`, so that each token and each text of the encoder's is written once.
_K3_TEMPLATE_SOURCE = Template(r"""
{#- Kimi K3 XTML (encoding_k3.py); see chat_template_kimi_k3.py in kimi_hf for the format and its choices -#}
{%- macro k3_attr(value) -%}
    {{- value | string | replace('&', '&amp;') | replace('"', '&quot;') -}}
{%- endmacro -%}
{%- macro k3_open(tag, attrs=[]) -%}
    {{- '${OPEN}' ~ tag -}}
    {%- for pair in attrs -%}
        {{- ' ' ~ pair[0] ~ '="' ~ k3_attr(pair[1]) ~ '"' -}}
    {%- endfor -%}
    {{- '${SEP}' -}}
{%- endmacro -%}
{%- macro k3_close(tag) -%}
    {{- '${CLOSE}' ~ tag ~ '${SEP}' -}}
{%- endmacro -%}
{%- macro k3_system(kind, body) -%}
    {{- k3_open('message', [('role', 'system'), ('type', kind)]) ~ (body | trim) ~ k3_close('message') ~ '${END_OF_MSG}' -}}
{%- endmacro -%}
{%- macro k3_json(value) -%}
    {{- value | tojson(separators=(',', ':'), sort_keys=True) -}}
{%- endmacro -%}
{%- macro k3_tool_declare(tool_list, dynamic) -%}
    {%- if dynamic -%}
        {%- set head = '${DYNAMIC_TOOL_DECLARE_HEAD}' -%}
    {%- else -%}
        {%- set head = '${TOOL_DECLARE_HEAD}' -%}
    {%- endif -%}
    {{- k3_system('tool-declare', head ~ '```json\n' ~ k3_json(tool_list) ~ '\n```') -}}
{%- endmacro -%}
{%- macro k3_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is not none and content is defined -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type in ['image', 'image_url'] -%}
                {{- '${IMAGE_PLACEHOLDER}' -}}
            {%- elif part.text is defined -%}
                {{- part.text | string -}}
            {%- else -%}
                {{- raise_exception('Kimi K3: a content part needs a "text" unless it is an image, got type ' ~ part.type | string) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro k3_type(value) -%}
    {%- if value is boolean -%}{{- 'boolean' -}}
    {%- elif value is none -%}{{- 'null' -}}
    {%- elif value is number -%}{{- 'number' -}}
    {%- elif value is string -%}{{- 'string' -}}
    {%- elif value is mapping -%}{{- 'object' -}}
    {%- else -%}{{- 'array' -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro k3_reply(message, think) -%}
    {#- what the model writes after the generation prompt (which opened the think / response channel) -#}
    {%- if think -%}
        {%- set reasoning = message.get('reasoning_content') or message.get('reasoning') -%}
        {%- if reasoning is not none and reasoning | string | trim -%}
            {{- reasoning | string -}}
        {%- endif -%}
        {{- k3_close('think') ~ k3_open('response') -}}
    {%- endif -%}
    {{- k3_content(message.get('content')) ~ k3_close('response') -}}
    {%- if message.get('tool_calls') -%}
        {{- k3_open('tools') -}}
        {%- for call in message.tool_calls -%}
            {%- if call is not mapping -%}
                {{- raise_exception('Kimi K3 tool calls must be objects.') -}}
            {%- endif -%}
            {%- set fn = call.function if call.function is mapping else call -%}
            {%- if fn.get('name') is not string or not fn.get('name') -%}
                {{- raise_exception('Kimi K3 tool calls require a non-empty function name.') -}}
            {%- endif -%}
            {{- k3_open('call', [('tool', fn.name), ('index', loop.index)]) -}}
            {%- set arguments = fn.get('arguments') -%}
            {%- if arguments is mapping -%}
                {%- for key, value in arguments.items() -%}
                    {{- k3_open('argument', [('key', key), ('type', k3_type(value))]) -}}
                    {{- (value if value is string else value | tojson) ~ k3_close('argument') -}}
                {%- endfor -%}
            {%- elif arguments is string -%}
                {%- if arguments | trim -%}
                    {{- k3_open('json', [('type', 'object')]) ~ arguments ~ k3_close('json') -}}
                {%- endif -%}
            {%- elif arguments is not none -%}
                {{- raise_exception('Kimi K3 tool call arguments must be a mapping or a JSON object string.') -}}
            {%- endif -%}
            {{- k3_close('call') -}}
        {%- endfor -%}
        {{- k3_close('tools') -}}
    {%- endif -%}
    {{- k3_close('message') ~ '${END_OF_MSG}' -}}
{%- endmacro -%}
{%- macro k3_tool_result(message, state, resolved) -%}
    {%- set state.tool_index = state.tool_index + 1 -%}
    {%- if resolved is not none -%}
        {%- set name = resolved -%}
    {%- elif 'tool' in message -%}
        {%- set name = message.tool -%}
    {%- else -%}
        {%- set name = message.get('name') -%}
    {%- endif -%}
    {%- if name is none and state.calls and state.tool_index <= state.calls | length -%}
        {%- set by_position = state.calls[state.tool_index - 1] -%}
        {%- set name = (by_position.function if by_position.function is mapping else by_position).get('name') -%}
    {%- endif -%}
    {%- if name is none -%}
        {{- raise_exception('Kimi K3 tool messages need a resolvable tool name: give `tool` / `name`, or follow an assistant message whose tool_calls match them by order.') -}}
    {%- endif -%}
    {{- k3_open('message', [('role', 'tool'), ('tool', name), ('index', state.tool_index)]) -}}
    {{- k3_content(message.get('content')) ~ k3_close('message') ~ '${END_OF_MSG}' -}}
{%- endmacro -%}
{#- ---- arguments ---- -#}
{%- if enable_thinking is defined and enable_thinking is not none -%}
    {%- set think = enable_thinking -%}
{%- elif thinking is defined and thinking is not none -%}
    {%- set think = thinking -%}
{%- else -%}
    {%- set think = true -%}
{%- endif -%}
{%- if thinking_effort is defined -%}
    {%- set effort = thinking_effort -%}
{%- elif reasoning_effort is defined -%}
    {%- set effort = reasoning_effort -%}
{%- else -%}
    {%- set effort = ${DEFAULT_THINKING_EFFORT} -%}
{%- endif -%}
{%- if think and effort is not none and effort not in ${VALID_THINKING_EFFORTS} -%}
    {{- raise_exception('Unsupported thinking_effort=' ~ effort | string ~ "; supported values are ${SORTED_THINKING_EFFORTS}.") -}}
{%- endif -%}
{%- set state = namespace(calls=none, tool_index=0) -%}
{#- ---- the encoder's preamble: tool declarations, then the thinking effort ---- -#}
{%- if tools -%}
    {{- k3_tool_declare(tools, false) -}}
{%- endif -%}
{%- if think and effort is not none -%}
    {{- k3_system('thinking-effort', '${EFFORT_PREAMBLE_HEAD}' ~ effort ~ '${EFFORT_PREAMBLE_TAIL}') -}}
{%- endif -%}
{#- ---- the conversation ---- -#}
{%- for message in messages -%}
    {%- if message.role == 'user' or (message.role == 'system' and not message.get('tools')) -%}
        {%- set attrs = [('role', message.role)] -%}
        {%- if message.get('name') -%}
            {%- set attrs = attrs + [('name', message.name)] -%}
        {%- endif -%}
        {{- k3_open('message', attrs) ~ k3_content(message.get('content')) ~ k3_close('message') ~ '${END_OF_MSG}' -}}
    {%- elif message.role == 'system' -%}
        {{- k3_tool_declare(message.tools, true) -}}
    {%- elif message.role == 'assistant' -%}
        {%- set state.calls = message.get('tool_calls') -%}
        {%- set state.tool_index = 0 -%}
        {%- set attrs = [('role', 'assistant')] -%}
        {%- if message.get('name') -%}
            {%- set attrs = attrs + [('name', message.name)] -%}
        {%- endif -%}
        {{- k3_open('message', attrs) ~ k3_open('think' if think else 'response') -}}
        {%- generation -%}
            {{- k3_reply(message, think) -}}
        {%- endgeneration -%}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {#- a run of results: in the calls' order when every one names a call by id -#}
            {%- set run = namespace(results=[], positions=[], names=[], matched=true) -%}
            {%- for result in messages[loop.index0:] -%}
                {%- if result.role != 'tool' -%}
                    {%- break -%}
                {%- endif -%}
                {%- set call_id = result.tool_call_id if 'tool_call_id' in result else result.get('id') -%}
                {%- set found = namespace(position=0, name=none) -%}
                {%- if call_id is not none and state.calls -%}
                    {%- for call in state.calls -%}
                        {%- if found.position == 0 and call is mapping and call.get('id') is not none and call.id | string == call_id | string -%}
                            {%- set found.position = loop.index -%}
                            {%- set found.name = (call.function if call.function is mapping else call).get('name') -%}
                        {%- endif -%}
                    {%- endfor -%}
                {%- endif -%}
                {%- if found.position == 0 -%}
                    {%- set run.matched = false -%}
                {%- endif -%}
                {%- set run.results = run.results + [result] -%}
                {%- set run.positions = run.positions + [found.position] -%}
                {%- set run.names = run.names + [found.name] -%}
            {%- endfor -%}
            {%- if run.matched -%}
                {%- for position in range(1, state.calls | length + 1) -%}
                    {%- for i in range(run.results | length) -%}
                        {%- if run.positions[i] == position -%}
                            {{- k3_tool_result(run.results[i], state, run.names[i]) -}}
                        {%- endif -%}
                    {%- endfor -%}
                {%- endfor -%}
            {%- else -%}
                {%- for result in run.results -%}
                    {{- k3_tool_result(result, state, none) -}}
                {%- endfor -%}
            {%- endif -%}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Kimi K3 chat messages have the roles system, user, assistant and tool, got ' ~ message.role | string) -}}
    {%- endif -%}
{%- endfor -%}
{#- ---- request switches, after the conversation ---- -#}
{%- if tool_choice is defined and tool_choice == 'required' -%}
    {{- k3_system('tool-choice', 'The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.') -}}
{%- elif tool_choice is defined and tool_choice == 'none' -%}
    {{- k3_system('tool-choice', 'The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.') -}}
{%- endif -%}
{%- if response_format is defined and response_format is not none -%}
    {%- set format_type = response_format.get('type') if response_format is mapping else response_format -%}
    {%- if format_type == 'json_object' -%}
        {{- k3_system('response-format', 'The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.') -}}
    {%- elif format_type == 'json_schema' -%}
        {%- if response_schema is defined and response_schema is not none -%}
            {%- set schema = response_schema -%}
        {%- else -%}
            {%- set wrapper = response_format.get('json_schema') if response_format is mapping else none -%}
            {%- if wrapper is mapping and 'schema' in wrapper -%}
                {%- set schema = wrapper.schema -%}
            {%- elif wrapper is mapping and 'json_schema' in wrapper -%}
                {%- set schema = wrapper.json_schema -%}
            {%- else -%}
                {%- set schema = wrapper -%}
            {%- endif -%}
        {%- endif -%}
        {{- k3_system('response-format', 'The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the following schema:\n```json\n' ~ k3_json(schema) ~ '\n```') -}}
    {%- endif -%}
{%- endif -%}
{%- if add_generation_prompt -%}
    {{- k3_open('message', [('role', 'assistant')]) ~ k3_open('think' if think else 'response') -}}
{%- endif -%}
""").safe_substitute(
    OPEN=_jinja_text(OPEN),
    CLOSE=_jinja_text(CLOSE),
    SEP=_jinja_text(SEP),
    END_OF_MSG=_jinja_text(END_OF_MSG),
    IMAGE_PLACEHOLDER=_jinja_text(IMAGE_PLACEHOLDER),
    TOOL_DECLARE_HEAD=_jinja_text(TOOL_DECLARE_HEAD),
    DYNAMIC_TOOL_DECLARE_HEAD=_jinja_text(DYNAMIC_TOOL_DECLARE_HEAD),
    EFFORT_PREAMBLE_HEAD=_jinja_text(THINKING_EFFORT_PREAMBLE.split("{effort}")[0]),
    EFFORT_PREAMBLE_TAIL=_jinja_text(THINKING_EFFORT_PREAMBLE.split("{effort}")[1]),
    VALID_THINKING_EFFORTS=repr(list(VALID_THINKING_EFFORTS)),  # a Jinja list literal
    SORTED_THINKING_EFFORTS=repr(sorted(VALID_THINKING_EFFORTS)),  # as the encoder's error message lists them
)


def k3_chat_template(default_thinking_effort: str | None = DEFAULT_THINKING_EFFORT) -> str:
    """K3's chat template with another default thinking effort: what a prompt gets without `thinking_effort=`.
    K3's own `apply_chat_template` defaults to "max" (K3_CHAT_TEMPLATE); None leaves the preamble out, so a model
    trained without it (the quickstart's) is prompted as it was trained."""
    if default_thinking_effort is not None and default_thinking_effort not in VALID_THINKING_EFFORTS:
        raise ValueError(
            f"default_thinking_effort must be one of {list(VALID_THINKING_EFFORTS)} or None, got "
            f"{default_thinking_effort!r}"
        )
    effort = "none" if default_thinking_effort is None else f"'{_jinja_text(default_thinking_effort)}'"
    return Template(_K3_TEMPLATE_SOURCE).substitute(DEFAULT_THINKING_EFFORT=effort).strip()


K3_CHAT_TEMPLATE = k3_chat_template()


# transformers' response parser spec (tokenizer.response_template) for K3's replies, for
# tokenizer.parse_response(text, prefix=prompt), `transformers serve` and TRL's tool loop. The prompt's
# generation prompt opened the think (or response) channel, and the prefix tells the parser so. It reads the
# think and response channels and `argument`-form calls; its limits (use `parse_k3_reply` where they matter):
# argument values stay strings unless `tools=` is passed (then transformers casts them by the tool's schema;
# the `type` attribute is not read), `&quot;` / `&amp;` in names are not decoded, and a call written as a
# `json` element comes back with empty arguments. Text after the message's end (`<|close|>message<|sep|>`,
# `<|end_of_msg|>`, `[EOS]`: pads, a next turn) lands in the `end` field, whose value is always empty, so it
# never reaches the parsed message.
K3_RESPONSE_TEMPLATE = {
    # an assistant message always has content (maybe empty), as transformers' own parsed messages do
    "defaults": {"role": "assistant", "content": ""},
    "start_anchor": ASSISTANT_HEADER,
    "fields": {
        "reasoning_content": {"open": THINK_OPEN, "close": THINK_CLOSE, "content_args": {"strip": False}},
        "content": {"open": RESPONSE_OPEN, "close": RESPONSE_CLOSE, "content_args": {"strip": False}},
        "tool_calls": {
            "open_pattern": re.escape(OPEN) + r'call tool="(?P<name>[^"]*)"[^<]*?' + re.escape(SEP),
            "close": CLOSE + "call" + SEP,
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": re.escape(OPEN)
                + r'argument key="(?P<key>[^"]*)"[^<]*?'
                + re.escape(SEP)
                + r"(?P<value>.*?)"
                + re.escape(CLOSE + "argument" + SEP),
                "value_parser": {"name": "text", "args": {"strip": False}},
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "end": {"open": [MESSAGE_CLOSE, END_OF_MSG, EOS], "transform": []},
    },
}


def normalize_k3_messages(messages: list[dict]) -> list[dict]:
    """Copies of `messages` with tool-call arguments given as JSON strings parsed into dicts, as K3's encoder
    does before rendering (arguments that do not parse stay strings: the template writes them in a `json`
    element, as the encoder does). Render these to get the encoder's exact bytes for OpenAI-style calls."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if not calls:
            out.append(message)
            continue
        fixed = []
        for call in calls:
            call = dict(call)
            holder = dict(call["function"]) if isinstance(call.get("function"), dict) else call
            arguments = holder.get("arguments")
            if isinstance(arguments, str):
                if not arguments.strip():
                    holder["arguments"] = {}
                else:
                    try:
                        parsed = json.loads(arguments)
                    except ValueError:
                        parsed = arguments
                    if not isinstance(parsed, (dict, str)):
                        raise ValueError("Kimi K3 tool call arguments must be a JSON object.")
                    holder["arguments"] = parsed
            if holder is not call:
                call["function"] = holder
            fixed.append(call)
        out.append({**message, "tool_calls": fixed})
    return out


def render_k3_reply(content: str = "", tool_calls=(), reasoning_content: str | None = None, thinking: bool = True):
    """The text a K3 model writes for this assistant message after the generation prompt (which opens the
    think channel, or with `thinking=False` the response channel), up to and including `<|end_of_msg|>`:
    rendered by K3_CHAT_TEMPLATE itself (transformers' Jinja renderer), so it is what training on the
    message teaches. tool_calls: OpenAI-style calls (dict or JSON-string arguments, as the template takes them)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    message = {"role": "assistant", "content": content, "reasoning_content": reasoning_content}
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    rendered, _ = render_jinja_template(
        conversations=[normalize_k3_messages([message])],
        chat_template=K3_CHAT_TEMPLATE,
        thinking_effort=None,
        enable_thinking=thinking,
    )
    start = GENERATION_PROMPT if thinking else ASSISTANT_HEADER + RESPONSE_OPEN
    if not rendered[0].startswith(start):
        raise ValueError(f"the K3 template rendered an assistant message that does not start with {start!r}")
    return rendered[0][len(start) :]


def has_k3_markup(tokenizer) -> bool:
    """Whether `tokenizer` has Kimi K3's chat markup (XTML: replies end with <|end_of_msg|>)."""
    end = tokenizer.convert_tokens_to_ids(K3_STOP_TOKEN)
    return end is not None and end != tokenizer.unk_token_id


def k3_stop_token_ids(tokenizer) -> list[int]:
    """The ids K3 chat generation stops on: <|end_of_msg|> (the end of every message, K3's config eos), then
    the tokenizer's eos ([EOS], the end of a document) when it differs."""
    ids = []
    end = tokenizer.convert_tokens_to_ids(K3_STOP_TOKEN)
    if end is not None and end != tokenizer.unk_token_id:
        ids.append(end)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def use_k3_chat_markup(tokenizer):
    """Sets K3's chat template and response template on `tokenizer` (saved with it); returns it."""
    tokenizer.chat_template = K3_CHAT_TEMPLATE
    tokenizer.response_template = K3_RESPONSE_TEMPLATE
    return tokenizer


__all__ = [
    "K3_CHAT_TEMPLATE",
    "k3_chat_template",
    "K3_RESPONSE_TEMPLATE",
    "VALID_THINKING_EFFORTS",
    "DEFAULT_THINKING_EFFORT",
    "THINKING_EFFORT_PREAMBLE",
    "TOOL_DECLARE_HEAD",
    "DYNAMIC_TOOL_DECLARE_HEAD",
    "normalize_k3_messages",
    "k3_stop_token_ids",
    "has_k3_markup",
    "render_k3_reply",
    "use_k3_chat_markup",
    # re-exported from reply_parser_kimi_k3, their home: earlier READMEs imported the parser from here
    "parse_k3_reply",
    "K3ReplyError",
]
