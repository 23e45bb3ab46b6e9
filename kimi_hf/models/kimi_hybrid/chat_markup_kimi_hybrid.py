"""Kimi's chat markup, in one place: its special tokens, the chat template (with Kimi's tool-calling format),
transformers' response parser spec for it, and the ids chat generation stops on.

    <|im_user|>user<|im_middle|>How many?<|im_end|><|im_assistant|>assistant<|im_middle|>3<|im_end|>

Images enter as <|media_begin|>image<|media_content|><|media_pad|><|media_end|> (the processor expands the
placeholder <|media_pad|> to one token per merged patch). Part of the flat, Hub-copyable model folder.
"""

import os

from transformers import GenerationConfig

from ..kimi_k3.chat_template_kimi_k3 import has_k3_markup, k3_stop_token_ids


SYSTEM, USER, ASSISTANT, MIDDLE = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"
TURN_END = "<|im_end|>"  # closes every chat turn: chat generation stops here (as well as at EOS)
MEDIA_BEGIN, MEDIA_CONTENT, IMAGE_TOKEN, MEDIA_END = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
)
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
CHAT_TOKENS = [SYSTEM, USER, ASSISTANT, MIDDLE, TURN_END]
MEDIA_TOKENS = [MEDIA_BEGIN, MEDIA_CONTENT, IMAGE_TOKEN, MEDIA_END]
TOOL_TOKENS = [TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_ARGUMENT_BEGIN, TOOL_CALL_END]
IMAGE_MARKUP = MEDIA_BEGIN + "image" + MEDIA_CONTENT + IMAGE_TOKEN + MEDIA_END

# Kimi's chat markup (content is a string or a list of {"type": "text" | "image", ...} parts), with its
# tool-calling format: tools declared in a `tool_declare` system turn, an assistant's calls as
# <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> inside a calls
# section, results as `tool` system turns naming the call id. What the assistant writes (its content,
# calls and the closing <|im_end|>) sits inside {% generation %} markers, so that
# `return_assistant_tokens_mask` and TRL's `assistant_only_loss` find the tokens to train on.
CHAT_TEMPLATE = (
    "{%- macro body(message) -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}"
    + IMAGE_MARKUP
    + "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for call in message['tool_calls'] -%}{%- set fn = call['function'] if call.get('function') else call -%}"
    "<|tool_call_begin|>{{ call.get('id') or 'functions.' ~ fn['name'] ~ ':' ~ loop.index0 }}<|tool_call_argument_begin|>"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- endmacro -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- generation -%}{{ body(message) }}{%- endgeneration -%}"
    "{%- else -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ message.get('tool_call_id') or message.get('name', '') }}{{ '\\n' }}"
    "{%- else -%}<|im_user|>user<|im_middle|>{%- endif -%}"
    "{{ body(message) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


# transformers' response parser spec for that markup (tokenizer.response_template): lets
# tokenizer.parse_response, `transformers serve` and TRL's tool loop read the assistant's tool calls.
RESPONSE_TEMPLATE = {
    # an assistant message always has content (maybe empty), as transformers' own parsed messages do
    "defaults": {"role": "assistant", "content": ""},
    "start_anchor": "<|im_assistant|>assistant<|im_middle|>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*(?:<\|tool_calls_section_begin\|>)?\s*<\|tool_call_begin\|>\s*(?:functions\.)?"
            r"(?P<name>[^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>",
            "close_pattern": r"<\|tool_call_end\|>\s*(?:<\|tool_calls_section_end\|>)?",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        # the turn ends at <|im_end|> (or EOS); everything after it (the pads of a batch, a next turn the
        # model went on to write) is not part of the reply
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|\[EOS\])[\s\S]*", "content": "text"},
    },
}


def chat_stop_token_ids(tokenizer) -> list[int]:
    """The ids that chat generation stops on: the tokenizer's EOS and, where it has Kimi's markup, the end
    of a turn (<|im_end|>: the chat template closes every reply with it, so a model trained on chats
    writes it, not EOS, when its reply is done). A tokenizer with K3's markup: `k3_stop_token_ids`
    (<|end_of_msg|> first, then EOS). Use it as the model config's `eos_token_id`."""
    if has_k3_markup(tokenizer):
        return k3_stop_token_ids(tokenizer)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    turn_end = tokenizer.convert_tokens_to_ids(TURN_END)
    if turn_end is not None and turn_end != tokenizer.unk_token_id and turn_end not in ids:
        ids.append(turn_end)
    return ids


def stop_at_turn_end(save_directory, tokenizer) -> None:
    """Adds the tokenizer's `chat_stop_token_ids` to the eos ids of the generation_config.json in save_directory
    (if there is one): a folder whose chat template ends turns with <|im_end|> (K3: <|end_of_msg|>) must also stop
    generating there."""
    if not os.path.isfile(os.path.join(save_directory, "generation_config.json")):
        return
    config = GenerationConfig.from_pretrained(save_directory)
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    missing = [i for i in chat_stop_token_ids(tokenizer) if i not in eos]
    if missing:
        config.eos_token_id = eos + missing
        config.save_pretrained(save_directory)


__all__ = [
    "CHAT_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "CHAT_TOKENS",
    "MEDIA_TOKENS",
    "TOOL_TOKENS",
    "IMAGE_TOKEN",
    "IMAGE_MARKUP",
    "TURN_END",
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
    "chat_stop_token_ids",
    "stop_at_turn_end",
]
