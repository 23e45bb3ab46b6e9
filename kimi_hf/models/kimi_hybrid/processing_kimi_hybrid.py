"""Processor of the early-fusion model: the image processor and the tokenizer, and the chat markup.

Each image placeholder (`<|media_pad|>`, inside K2.5's markup
`<|media_begin|>image<|media_content|><|media_pad|><|media_end|>`) is expanded to one token per
merged patch group of its image (h * w / merge^2), images taken in order across the batch; the model
writes the image features into exactly those positions.
"""

from __future__ import annotations

from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

from ..hub_kimi import RemoteCodeProcessorMixin
from .chat_markup_kimi_hybrid import (  # noqa: F401  (re-exported: the markup's names as they were)
    CHAT_TEMPLATE,
    IMAGE_MARKUP,
    IMAGE_TOKEN,
    RESPONSE_TEMPLATE,
    TURN_END,
    add_eos_token_ids,
    stop_at_turn_end,
)
from .chat_markup_kimi_hybrid import kimi_stop_token_ids as chat_stop_token_ids  # Kimi markup only: K3 overrides


class KimiHybridProcessor(RemoteCodeProcessorMixin, ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template or self.default_chat_template)
        self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {self.image_token!r} token (the image placeholder)")

    default_chat_template = CHAT_TEMPLATE

    def image_placeholder_for(self, texts: list[str]) -> str:
        """The text that stands for one image in these prompts (K2.5's markup: the pad token itself)."""
        return self.image_token

    def image_prompt(self, placeholder: str, tokens: int, height: int, width: int) -> str:
        """What one placeholder becomes for an image of height x width pixels taking `tokens` features."""
        return self.image_token * tokens

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
        placeholder = self.image_placeholder_for(texts)
        slots = sum(t.count(placeholder) for t in texts)
        if images is not None and not (isinstance(images, (list, tuple)) and len(images) == 0):
            image_inputs = self.image_processor(images, return_tensors="pt", return_image_sizes=True)
            sizes = image_inputs.pop("image_sizes").tolist()
            grid = image_inputs["image_grid_thw"]
            if slots != len(grid):
                raise ValueError(
                    f"text has {slots} image placeholders ({placeholder}) but {len(grid)} images were given"
                )
            merge = self.image_processor.merge_size**2
            prompts = iter(
                self.image_prompt(placeholder, n, h, w) for n, (h, w) in zip((grid.prod(-1) // merge).tolist(), sizes)
            )
            # each placeholder expands exactly once, images in order across the batch
            texts = [
                "".join(part if i == 0 else next(prompts) + part for i, part in enumerate(t.split(placeholder)))
                for t in texts
            ]
        elif slots:
            raise ValueError(f"text has {slots} image placeholders ({placeholder}) but no images were given")
        text_kwargs = {k: v for k, v in kwargs.items() if k not in ("videos", "audio")}
        text_kwargs.pop("text_kwargs", None)
        encoded = self.tokenizer(texts, return_tensors=return_tensors, **text_kwargs)
        return BatchFeature(data={**encoded, **image_inputs}, tensor_type=return_tensors)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        """transformers' `ProcessorMixin.apply_chat_template`, except that `tokenize=True` without `return_tensors`
        gives lists, as a tokenizer's template and most of transformers' processors do (calling the processor gives
        tensors by default, which TRL's check of the template's stop token, given the processor, misreads)."""
        if kwargs.get("tokenize") and kwargs.get("return_tensors", "auto") == "auto":
            kwargs["return_tensors"] = None
        return super().apply_chat_template(conversation, chat_template, **kwargs)

    def stop_token_ids(self) -> list[int]:
        """The ids chat generation stops on (chat_stop_token_ids: added to a generation_config.json saved in the
        same folder; K3's markup: <|end_of_msg|>, then EOS)."""
        return chat_stop_token_ids(self.tokenizer)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Also makes a model saved in the same folder stop generating at the end of a chat turn: its
        generation_config.json gets the missing `stop_token_ids`, in their order."""
        out = super().save_pretrained(save_directory, *args, **kwargs)
        add_eos_token_ids(save_directory, self.stop_token_ids())
        return out

    def num_image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens an image of height x width pixels takes."""
        return self.image_processor.get_number_of_image_tokens(height, width)

    def post_process_image_text_to_text(self, generated_outputs, skip_special_tokens=True, **kwargs):
        return self.tokenizer.batch_decode(generated_outputs, skip_special_tokens=skip_special_tokens, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        return list(dict.fromkeys(self.tokenizer.model_input_names + self.image_processor.model_input_names))


__all__ = [
    "KimiHybridProcessor",
    "CHAT_TEMPLATE",
    "RESPONSE_TEMPLATE",
    "IMAGE_TOKEN",
    "IMAGE_MARKUP",
    "TURN_END",
    "chat_stop_token_ids",
    "stop_at_turn_end",
]
