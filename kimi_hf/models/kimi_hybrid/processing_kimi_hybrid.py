"""Processor of the early-fusion model: the image processor and the tokenizer, and the chat markup.

Each image placeholder (`<|media_pad|>`, inside K2.5's markup
`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`) is expanded to one token per
merged patch group of its image (h * w / merge^2), images taken in order across the batch; the model
writes the image features into exactly those positions.
"""

from __future__ import annotations

import os

from transformers import GenerationConfig
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

IMAGE_TOKEN = "<|media_pad|>"
IMAGE_MARKUP = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
TURN_END = "<|im_end|>"  # closes every chat turn: chat generation stops here (as well as at EOS)

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
    "{%- if part['type'] == 'image' -%}" + IMAGE_MARKUP +
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
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
    "defaults": {"role": "assistant"},
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
    writes it, not EOS, when its reply is done). Use it as the model config's `eos_token_id`."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    turn_end = tokenizer.convert_tokens_to_ids(TURN_END)
    if turn_end is not None and turn_end != tokenizer.unk_token_id and turn_end not in ids:
        ids.append(turn_end)
    return ids


def stop_at_turn_end(save_directory, tokenizer) -> None:
    """Adds the turn end to the eos ids of the generation_config.json in save_directory (if there is one):
    a folder whose chat template ends turns with <|im_end|> must also stop generating there."""
    if not os.path.isfile(os.path.join(save_directory, "generation_config.json")):
        return
    config = GenerationConfig.from_pretrained(save_directory)
    eos = config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    missing = [i for i in chat_stop_token_ids(tokenizer) if i not in eos]
    if missing:
        config.eos_token_id = eos + missing
        config.save_pretrained(save_directory)


class KimiHybridProcessor(ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template or CHAT_TEMPLATE)
        self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {self.image_token!r} token (the image placeholder)")

    def __call__(self, images=None, text=None, **kwargs) -> BatchFeature:
        """text: a string or a list of strings with one placeholder per image; images: an image, a list
        of images, or one list per prompt (flattened in order). Returns input_ids, attention_mask and,
        with images, pixel_values and image_grid_thw."""
        if text is None:
            raise ValueError("text is required (with one image placeholder per image)")
        texts = [text] if isinstance(text, str) else list(text)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("text must be a string or a list of strings")
        return_tensors = kwargs.pop("return_tensors", "pt")
        kwargs.pop("images_kwargs", None)
        image_inputs = {}
        slots = sum(t.count(self.image_token) for t in texts)
        if images is not None and not (isinstance(images, (list, tuple)) and len(images) == 0):
            image_inputs = self.image_processor(images, return_tensors="pt")
            grid = image_inputs["image_grid_thw"]
            if slots != len(grid):
                raise ValueError(f"text has {slots} image placeholders ({self.image_token}) but {len(grid)} images were given")
            merge = self.image_processor.merge_size ** 2
            counts = iter((grid.prod(-1) // merge).tolist())
            marker = "\0image\0"  # expand each placeholder exactly once, in order
            texts = [t.replace(self.image_token, marker) for t in texts]
            texts = ["".join(part if i == 0 else self.image_token * next(counts) + part
                             for i, part in enumerate(t.split(marker))) for t in texts]
        elif slots:
            raise ValueError(f"text has {slots} image placeholders ({self.image_token}) but no images were given")
        text_kwargs = {k: v for k, v in kwargs.items() if k not in ("videos", "audio")}
        text_kwargs.pop("text_kwargs", None)
        encoded = self.tokenizer(texts, return_tensors=return_tensors, **text_kwargs)
        return BatchFeature(data={**encoded, **image_inputs}, tensor_type=return_tensors)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Also makes a model saved in the same folder stop generating at the end of a chat turn."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        stop_at_turn_end(save_directory, self.tokenizer)
        return out

    def num_image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens an image of height x width pixels takes."""
        return self.image_processor.get_number_of_image_tokens(height, width)

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True, **kwargs):
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        return list(dict.fromkeys(self.tokenizer.model_input_names + self.image_processor.model_input_names))


KimiHybridProcessor.register_for_auto_class("AutoProcessor")  # saved processors carry auto_map and this file

__all__ = ["KimiHybridProcessor", "CHAT_TEMPLATE", "RESPONSE_TEMPLATE", "IMAGE_TOKEN", "IMAGE_MARKUP", "TURN_END",
           "chat_stop_token_ids", "stop_at_turn_end"]
