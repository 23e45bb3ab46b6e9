"""Kimi K3's processor: its image processor, its tokenizer and its chat markup (XTML), for `AutoProcessor` on a
K3 folder (ours, or the release itself: its `preprocessor_config.json` and `tiktoken.model` are read directly).

K3's chat template writes each image as the text `<|kimi_image_placeholder|>`. The processor replaces it, as
K3's own processor does, with the media block naming the image's original size,

    <|media_begin|>image {width}x{height}<|media_content|><|media_pad|> x N<|media_end|>

except that the one `<|media_pad|>` of K3's own processor (which its model widens in its forward) is already
N of them here, N = the image's merged patch groups (h * w / merge^2): the model writes the image features into
exactly those positions, as vLLM's K3 prompt update does, so the cache, position ids and attention mask are
those of the sequence the model runs. A prompt already in K3's own single-pad form (one `<|media_pad|>` per
image and no placeholder) is widened the same way.

    processor = AutoProcessor.from_pretrained(k3_folder)
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True, return_tensors="pt")
    model.generate(**inputs)      # stops at <|end_of_msg|> (generation_config.json's eos)
"""

from __future__ import annotations

import json
import os

from ..kimi_hybrid.processing_kimi_hybrid import KimiHybridProcessor
from .chat_template_kimi_k3 import K3_CHAT_TEMPLATE, K3_RESPONSE_TEMPLATE, k3_stop_token_ids
from .image_processing_kimi_k3 import KimiK3ImageProcessor
from .tokenization_kimi_k3 import tiktoken_to_fast
from .xtml_kimi_k3 import IMAGE_PLACEHOLDER, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD


class KimiK3Processor(KimiHybridProcessor):
    """KimiK3ImageProcessor + K3's tokenizer (with K3's chat template and response template) -> input_ids,
    attention_mask, pixel_values, image_grid_thw for KimiK3ForConditionalGeneration."""

    default_chat_template = K3_CHAT_TEMPLATE

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        if tokenizer is not None and getattr(tokenizer, "image_token", None) is None:
            tokenizer.image_token = MEDIA_PAD  # the position the model fills (config.media_placeholder_token_id)
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)
        self.image_placeholder = kwargs.get("image_placeholder", IMAGE_PLACEHOLDER)
        missing = [t for t in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END) if self._token_id(t) is None]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s) (K3's media markup)")
        if getattr(tokenizer, "response_template", None) is None:
            tokenizer.response_template = K3_RESPONSE_TEMPLATE  # parse_response / serve read replies with it

    def stop_token_ids(self) -> list[int]:
        """The ids K3 chat generation stops on (`k3_stop_token_ids`: <|end_of_msg|>, then [EOS]), added to a
        generation_config.json saved in the same folder."""
        return k3_stop_token_ids(self.tokenizer)

    def _token_id(self, token: str) -> int | None:
        i = self.tokenizer.convert_tokens_to_ids(token)
        return None if i is None or i == self.tokenizer.unk_token_id else i

    def image_placeholder_for(self, texts: list[str]) -> str:
        # K3's placeholder text, or (for prompts without it) K3's own processor's single pad per image
        return self.image_placeholder if any(self.image_placeholder in t for t in texts) else MEDIA_PAD

    def image_prompt(self, placeholder: str, tokens: int, height: int, width: int) -> str:
        pads = MEDIA_PAD * tokens
        if placeholder == MEDIA_PAD:  # already inside its media block
            return pads
        return f"{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}{pads}{MEDIA_END}"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Our saved folders load as usual. A local folder as K3 is released (`preprocessor_config.json` with
        K3's `media_proc_cfg`, `tiktoken.model` without `tokenizer.json`) is read directly: the tiktoken ranks
        are converted to a fast tokenizer in memory (tokenization_kimi_k3, beside this module, also in a saved folder;
        no tiktoken package)."""
        folder = os.fspath(pretrained_model_name_or_path)
        if not os.path.isdir(folder):
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        image_config = os.path.join(folder, "preprocessor_config.json")
        settings = {}
        if os.path.isfile(image_config):
            with open(image_config, encoding="utf-8") as f:
                settings = json.load(f)
        released_images = bool(settings) and "image_processor_type" not in settings
        released_tokenizer = not os.path.isfile(os.path.join(folder, "tokenizer.json")) and os.path.isfile(
            os.path.join(folder, "tiktoken.model")
        )
        if not (released_images or released_tokenizer):
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        if released_images:
            image_processor = KimiK3ImageProcessor(**settings)
        elif os.path.isfile(image_config):
            image_processor = KimiK3ImageProcessor.from_pretrained(folder)
        else:
            image_processor = KimiK3ImageProcessor()
        if released_tokenizer:
            tokenizer = tiktoken_to_fast(
                os.path.join(folder, "tiktoken.model"), os.path.join(folder, "tokenizer_config.json")
            )
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
        chat_template = kwargs.pop("chat_template", None)
        return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


__all__ = ["KimiK3Processor"]
