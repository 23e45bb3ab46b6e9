"""The early-fusion multimodal model: the MoonViT tower's merged patches, projected to the text
hidden size, are written into the `image_token_id` placeholder positions of the token stream, which
the hybrid KDA/MLA decoder then reads like any other tokens (SPEC 3).

    KimiHybridModel                      vision_tower + mm_projector + language_model (no head)
    KimiHybridForConditionalGeneration   + lm_head; generate() encodes the images once, at prefill
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_kimi_hybrid import KimiHybridConfig
from .hub_kimi_hybrid import RemoteCodeMixin
from .modeling_kimi_hybrid import KimiHybridTextModel, _cached_length, lm_output
from .modeling_kimi_hybrid_vision import KimiHybridMultimodalProjector, KimiHybridVisionModel


class KimiHybridMultimodalPreTrainedModel(RemoteCodeMixin, PreTrainedModel):
    config: KimiHybridConfig
    config_class = KimiHybridConfig
    base_model_prefix = "model"
    input_modalities = ("image", "text")
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiHybridDecoderLayer", "KimiHybridVisionEncoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _is_stateful = True


class KimiHybridModel(KimiHybridMultimodalPreTrainedModel):
    def __init__(self, config: KimiHybridConfig):
        super().__init__(config)
        vc = config.vision_config
        self.vision_tower = KimiHybridVisionModel._from_config(vc)
        self.mm_projector = KimiHybridMultimodalProjector(
            vc.hidden_size, vc.merge_kernel_size[0] * vc.merge_kernel_size[1], config.text_config.hidden_size,
            config.projection_layer_norm_eps)
        self.language_model = KimiHybridTextModel._from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, p, p], image_grid_thw [I, 3] -> [sum_i t h w / (kh kw), text hidden]: one
        embedding per merged patch group, images in order."""
        vision = self.vision_tower(pixel_values, image_grid_thw)
        return self.mm_projector(vision.pooler_output)

    def embed(self, input_ids: torch.LongTensor, pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
              decoding: bool) -> torch.Tensor:
        """Token embeddings with the image features written into the placeholder positions."""
        is_image = input_ids == self.config.image_token_id
        embeds = self.get_input_embeddings()(input_ids.masked_fill(is_image, 0))
        n_slots = int(is_image.sum())
        if pixel_values is None or (decoding and n_slots == 0):  # decoding: the images are in the cache already
            if n_slots and not decoding:
                raise ValueError(f"input_ids hold {n_slots} image placeholder tokens (id {self.config.image_token_id}) "
                                 "but no pixel_values were given")
            return embeds
        if image_grid_thw is None:
            raise ValueError("pixel_values need image_grid_thw (one [t, h, w] row per image)")
        features = self.get_image_features(pixel_values, image_grid_thw)
        if features.shape[0] != n_slots:  # never shift text against images silently
            raise ValueError(f"input_ids hold {n_slots} image placeholder tokens but the images give {features.shape[0]} "
                             "features (one per merged patch group): the processor expands each image placeholder to "
                             "h * w / merge^2 tokens")
        return embeds.masked_scatter(is_image[..., None].expand_as(embeds), features.to(embeds.dtype))

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, cache: Cache | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> MoeModelOutputWithPast:
        past_key_values = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, pixel_values, image_grid_thw, _cached_length(past_key_values) > 0)
        elif pixel_values is not None:
            raise ValueError("pixel_values need input_ids (the image placeholders mark where the features go)")
        return self.language_model(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, use_cache=use_cache, **kwargs)


class KimiHybridForConditionalGeneration(KimiHybridMultimodalPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}

    def __init__(self, config: KimiHybridConfig):
        super().__init__(config)
        self.model = KimiHybridModel(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.model.get_image_features(pixel_values, image_grid_thw)

    @can_return_tuple
    def forward(self, input_ids: torch.LongTensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_router_logits: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, cache: Cache | None = None,
                **kwargs: Unpack[TransformersKwargs]) -> MoeCausalLMOutputWithPast:
        text_config = self.config.text_config
        if output_router_logits is None:
            output_router_logits = text_config.output_router_logits
        outputs = self.model(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                             attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                             use_cache=use_cache, output_router_logits=output_router_logits, **kwargs)
        return lm_output(self, outputs, text_config, labels, attention_mask, logits_to_keep, output_router_logits, **kwargs)


__all__ = ["KimiHybridModel", "KimiHybridForConditionalGeneration", "KimiHybridMultimodalPreTrainedModel"]
