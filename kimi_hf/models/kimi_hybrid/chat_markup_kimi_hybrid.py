"""Kimi's chat markup (Kimi K2 / K2.5 / Kimi Linear), in one place: its special tokens, the chat template (with
Kimi's tool-calling format), transformers' response parser spec for it, the text of a reply, and the ids chat
generation stops on.

    <|im_user|>user<|im_middle|>How many?<|im_end|><|im_assistant|>assistant<|im_middle|>3<|im_end|>

Images enter as <|media_begin|>image<|media_content|><|media_pad|><|media_end|> (the processor expands the
placeholder <|media_pad|> to one token per merged patch). Part of the flat, Hub-copyable model folder: it knows
Kimi's markup only (Kimi K3's XTML is kimi_k3's, which imports the tokens the two share from here; code that takes
either kind of tokenizer picks in `kimi_hf.chat`), so that a Kimi Linear Hub folder ships no K3 code.
"""

import os
import re
from string import Template

from transformers import GenerationConfig


# The token table of Kimi's markup: every string here is a special token of Kimi's tokenizers, declared once
# (K3's token table, kimi_k3's xtml_kimi_k3.py, imports the document and media tokens: K3's tokenizer has them too).
# Document tokens: the tokenizer's bos / eos (end of a document, not of a chat turn) / pad / unk.
BOS, EOS, PAD, UNK = "[BOS]", "[EOS]", "[PAD]", "[UNK]"
# Chat turns: a role token, the role's name, <|im_middle|>, the content, <|im_end|>.
SYSTEM, USER, ASSISTANT, MIDDLE = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"
TURN_END = "<|im_end|>"  # closes every chat turn: chat generation stops here (as well as at EOS)
# Media: one image is IMAGE_MARKUP; IMAGE_TOKEN (<|media_pad|>) is the placeholder the processor expands.
MEDIA_BEGIN, MEDIA_CONTENT, IMAGE_TOKEN, MEDIA_END = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
)
# Tool calls: a section of calls, each functions.NAME:IDX, then its JSON arguments.
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
# The groups, in the order the small trained tokenizer (kimi_hf.tokenization) gives them ids.
CHAT_TOKENS = [SYSTEM, USER, ASSISTANT, MIDDLE, TURN_END]
KIMI_MEDIA_TOKENS = [MEDIA_BEGIN, MEDIA_CONTENT, IMAGE_TOKEN, MEDIA_END]  # in markup order (K3's: K3_MEDIA_TOKENS)
TOOL_TOKENS = [TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END]
IMAGE_MARKUP = MEDIA_BEGIN + "image" + MEDIA_CONTENT + IMAGE_TOKEN + MEDIA_END
# what the generation prompt writes: an assistant turn's opening, after which the model writes its reply
KIMI_GENERATION_PROMPT = ASSISTANT + "assistant" + MIDDLE

# Kimi's chat markup (content is a string or a list of {"type": "text" | "image", ...} parts), with its
# tool-calling format: tools declared in a `tool_declare` system turn, an assistant's calls as
# <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> inside a calls
# section, results as `tool` system turns naming the call id. What the assistant writes (its content,
# calls and the closing <|im_end|>) sits inside {% generation %} markers, so that
# `return_assistant_tokens_mask` and TRL's `assistant_only_loss` find the tokens to train on. `${NAME}` is a
# string of the table above (string.Template: Jinja has no `$`), so each token is written once.
CHAT_TEMPLATE = Template(
    "{%- macro body(message) -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}${IMAGE_MARKUP}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}${TOOL_CALLS_BEGIN}"
    "{%- for call in message['tool_calls'] -%}{%- set fn = call['function'] if call.get('function') else call -%}"
    "${TOOL_CALL_BEGIN}{{ call.get('id') or 'functions.' ~ fn['name'] ~ ':' ~ loop.index0 }}${TOOL_CALL_ARGUMENT_BEGIN}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "${TOOL_CALL_END}{%- endfor -%}${TOOL_CALLS_END}{%- endif -%}"
    "${TURN_END}"
    "{%- endmacro -%}"
    "{%- if tools -%}${SYSTEM}tool_declare${MIDDLE}{{ tools | tojson }}${TURN_END}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}${KIMI_GENERATION_PROMPT}"
    "{%- generation -%}{{ body(message) }}{%- endgeneration -%}"
    "{%- else -%}"
    "{%- if message['role'] == 'system' -%}${SYSTEM}system${MIDDLE}"
    "{%- elif message['role'] == 'tool' -%}${SYSTEM}tool${MIDDLE}## Return of {{ message.get('tool_call_id') or message.get('name', '') }}{{ '\\n' }}"
    "{%- else -%}${USER}user${MIDDLE}{%- endif -%}"
    "{{ body(message) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}${KIMI_GENERATION_PROMPT}{%- endif -%}"
).substitute(
    IMAGE_MARKUP=IMAGE_MARKUP,
    TOOL_CALLS_BEGIN=TOOL_CALLS_BEGIN,
    TOOL_CALL_BEGIN=TOOL_CALL_BEGIN,
    TOOL_CALL_ARGUMENT_BEGIN=TOOL_CALL_ARGUMENT_BEGIN,
    TOOL_CALL_END=TOOL_CALL_END,
    TOOL_CALLS_END=TOOL_CALLS_END,
    TURN_END=TURN_END,
    SYSTEM=SYSTEM,
    USER=USER,
    MIDDLE=MIDDLE,
    KIMI_GENERATION_PROMPT=KIMI_GENERATION_PROMPT,
)


# transformers' response parser spec for that markup (tokenizer.response_template): lets
# tokenizer.parse_response, `transformers serve` and TRL's tool loop read the assistant's tool calls.
RESPONSE_TEMPLATE = {
    # an assistant message always has content (maybe empty), as transformers' own parsed messages do
    "defaults": {"role": "assistant", "content": ""},
    "start_anchor": KIMI_GENERATION_PROMPT,
    "fields": {
        "tool_calls": {
            "open_pattern": rf"\s*(?:{re.escape(TOOL_CALLS_BEGIN)})?\s*{re.escape(TOOL_CALL_BEGIN)}\s*(?:functions\.)?"
            rf"(?P<name>[^:<\s]+)(?::\d+)?\s*{re.escape(TOOL_CALL_ARGUMENT_BEGIN)}",
            "close_pattern": rf"{re.escape(TOOL_CALL_END)}\s*(?:{re.escape(TOOL_CALLS_END)})?",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        # the turn ends at <|im_end|> (or EOS); everything after it (the pads of a batch, a next turn the
        # model went on to write) is not part of the reply
        "content": {"close_pattern": rf"\s*(?:{re.escape(TURN_END)}|{re.escape(EOS)})[\s\S]*", "content": "text"},
    },
}


def render_kimi_reply(content: str = "", tool_calls=()) -> str:
    """The text a Kimi model writes for this assistant message after the generation prompt, up to and including
    `<|im_end|>`: rendered by CHAT_TEMPLATE itself (transformers' Jinja renderer), so it is what training on the
    message teaches and what RESPONSE_TEMPLATE reads. tool_calls: OpenAI-style calls (dict arguments are written
    with the template's `tojson`, string arguments as they are; a call without an `id` is `functions.NAME:IDX`)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    rendered, _ = render_jinja_template(conversations=[[message]], chat_template=CHAT_TEMPLATE)
    if not rendered[0].startswith(KIMI_GENERATION_PROMPT):
        raise ValueError(
            f"the chat template rendered an assistant turn that does not start {KIMI_GENERATION_PROMPT!r}"
        )
    return rendered[0][len(KIMI_GENERATION_PROMPT) :]


def kimi_stop_token_ids(tokenizer) -> list[int]:
    """The ids chat generation on Kimi's markup stops on: the tokenizer's EOS and, where it has the token, the end
    of a turn (<|im_end|>: the chat template closes every reply with it, so a model trained on chats writes it,
    not EOS, when its reply is done). Kimi K3's markup ends its messages otherwise (`k3_stop_token_ids`);
    `kimi_hf.chat.chat_stop_token_ids` picks by the tokenizer."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    turn_end = tokenizer.convert_tokens_to_ids(TURN_END)
    if turn_end is not None and turn_end != tokenizer.unk_token_id and turn_end not in ids:
        ids.append(turn_end)
    return ids


def add_eos_token_ids(save_directory, stop_ids) -> None:
    """Appends the ids of `stop_ids` that the generation_config.json in save_directory (if there is one) lacks to
    its eos ids, in that order."""
    if not os.path.isfile(os.path.join(save_directory, "generation_config.json")):
        return
    config = GenerationConfig.from_pretrained(save_directory)
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    missing = [i for i in stop_ids if i not in eos]
    if missing:
        config.eos_token_id = eos + missing
        config.save_pretrained(save_directory)


def stop_at_turn_end(save_directory, tokenizer) -> None:
    """Adds `kimi_stop_token_ids(tokenizer)` to the eos ids of the generation_config.json in save_directory (if
    there is one): a folder whose chat template ends turns with <|im_end|> must also stop generating there."""
    add_eos_token_ids(save_directory, kimi_stop_token_ids(tokenizer))


__all__ = [
    "CHAT_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "CHAT_TOKENS",
    "KIMI_MEDIA_TOKENS",
    "TOOL_TOKENS",
    "IMAGE_TOKEN",
    "IMAGE_MARKUP",
    "KIMI_GENERATION_PROMPT",
    "TURN_END",
    "BOS",
    "EOS",
    "PAD",
    "UNK",
    "SYSTEM",
    "USER",
    "ASSISTANT",
    "MIDDLE",
    "MEDIA_BEGIN",
    "MEDIA_CONTENT",
    "MEDIA_END",
    "TOOL_CALLS_BEGIN",
    "TOOL_CALLS_END",
    "TOOL_CALL_BEGIN",
    "TOOL_CALL_ARGUMENT_BEGIN",
    "TOOL_CALL_END",
    "render_kimi_reply",
    "kimi_stop_token_ids",
    "add_eos_token_ids",
    "stop_at_turn_end",
]
