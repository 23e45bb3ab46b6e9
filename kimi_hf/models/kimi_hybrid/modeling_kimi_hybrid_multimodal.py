"""The early-fusion multimodal model: the MoonViT tower's merged patches, projected to the text
hidden size, are written into the `image_token_id` placeholder positions of the token stream, which
the hybrid KDA/MLA decoder then reads like any other tokens (early fusion, Kimi K2.5: arXiv 2602.02276).

    KimiHybridModel                      vision_tower + mm_projector + language_model (no head)
    KimiHybridForConditionalGeneration   + lm_head; generate() encodes the images once, at prefill
"""

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MultimodalMoeBaseModelOutputWithPast,
    MultimodalMoeCausalLMOutputWithPast,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from ..hub_kimi import RemoteCodeMixin
from .configuration_kimi_hybrid import KimiHybridConfig
from .modeling_kimi_hybrid import KimiHybridTextModel, _cached_length, lm_output
from .modeling_kimi_hybrid_vision import KimiHybridVisionModel, build_multimodal_projector
from .parallel_kimi_hybrid import check_parallel_layout
from .pipeline_kimi_hybrid import distribute_for_stage, prepare_stage_mesh, prune_to_active_stage


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


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
    # decoding steps (text tokens over the cache) compile as the text model's do; the prefill with images does not
    # (the vision tower's shapes follow each image's grid) and generate runs it eagerly
    _can_compile_fullgraph = True

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """transformers tells whether `set_experts_implementation` / `experts_implementation=` apply by looking for
        `@use_experts_implementation` in the class's own module; this model's experts are its decoder's
        (modeling_kimi_hybrid.py, KimiHybridExperts), which the switch reaches through the sub-config."""
        return True

    @classmethod
    def prepare_distribute_model(cls, distributed_config, device_map=None):
        """transformers' meshes, with the pipeline dimension when one stage loads with expert / tensor parallelism
        (kimi_hf.distributed.load_pipeline_stage: prepare_stage_mesh)."""
        prepared = prepare_stage_mesh(distributed_config, device_map)
        return prepared if prepared is not None else super().prepare_distribute_model(distributed_config, device_map)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' parallelism at load time: the decoder takes the text model's plan under
        model.language_model. (the vision tower and projector replicated), with the text model's checks
        (check_parallel_layout); pipeline parallelism is refused by name."""
        prune_to_active_stage(model)  # kimi_hf.distributed.load_pipeline_stage: before any tensor is read
        if distributed_config is not None:
            check_parallel_layout(model.config.get_text_config(), model.tp_plan, distributed_config, multimodal=True)
        return distribute_for_stage(super().maybe_distribute_model, model, distributed_config, mesh_manager)


class KimiHybridModel(KimiHybridMultimodalPreTrainedModel):
    text_model_class = KimiHybridTextModel  # Kimi K3's subclass sets its own (its checkpoint conversion differs)

    def __init__(self, config: KimiHybridConfig):
        super().__init__(config)
        vc = config.vision_config
        # sub-models in the dtype this model is built in: _from_config would follow a sub-config's own `dtype`
        # (Kimi K3's released text_config says bfloat16), leaving the tower and the decoder in different dtypes
        dtype = torch.get_default_dtype()
        self.vision_tower = KimiHybridVisionModel._from_config(vc, dtype=dtype)
        # K2.5's patchmerger or K3's patchmergerv2, after vision_config.projector_type
        self.mm_projector = build_multimodal_projector(
            vc, config.text_config.hidden_size, config.projection_layer_norm_eps
        )
        self.language_model = self.text_model_class._from_config(config.text_config, dtype=dtype)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    @can_return_tuple
    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.LongTensor, **kwargs: Unpack[TransformersKwargs]
    ) -> tuple | BaseModelOutputWithPooling:
        """pixel_values [N, 3, p, p], image_grid_thw [I, 3] -> the vision tower's output (last_hidden_state
        [N, D]; hidden_states / attentions when asked with output_hidden_states / output_attentions) whose
        pooler_output is, as in transformers' kimi_k25, a tuple with one [h w / (kh kw), text hidden]
        tensor per image (frames of a video merged): one embedding per merged patch group, images in order."""
        vision = self.vision_tower(pixel_values, image_grid_thw, **kwargs)
        features = self.mm_projector(vision.pooler_output)
        kh, kw = self.vision_tower.merge_kernel_size
        vision.pooler_output = torch.split(features, (image_grid_thw[:, 1:].prod(-1) // (kh * kw)).tolist())
        return vision

    def get_placeholder_mask(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor,
        image_features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, T, 1] bool: the image placeholder positions, from input_ids or, without them, the positions of
        inputs_embeds equal (in every dimension) to the embedding of `image_token_id`. With image_features
        [n, hidden], checks that there is one placeholder per feature."""
        if input_ids is None:
            token = torch.tensor(self.config.image_token_id, dtype=torch.long, device=inputs_embeds.device)
            placeholder = self.get_input_embeddings()(token).to(inputs_embeds.device, inputs_embeds.dtype)
            mask = (inputs_embeds == placeholder).all(-1)
        else:
            mask = input_ids == self.config.image_token_id
        mask = mask[..., None].to(inputs_embeds.device)
        if image_features is not None:
            self._check_placeholder_count(
                mask, image_features, "input_ids" if input_ids is not None else "inputs_embeds"
            )
        return mask

    def _check_placeholder_count(self, mask: torch.Tensor, image_features: torch.Tensor, source: str):
        n_slots, n_features = int(mask.sum()), image_features.shape[0]
        if n_slots != n_features:  # never shift text against images silently
            raise ValueError(
                f"{source} hold {n_slots} image placeholder tokens but the images give {n_features} features "
                f"(one per merged patch group; placeholder id {self.config.image_token_id}): the processor "
                "expands each image placeholder to h * w / merge^2 tokens"
            )

    def embed(
        self,
        input_ids: torch.LongTensor | None,
        pixel_values: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        past_key_values: Cache | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, BaseModelOutputWithPooling | None]:
        """Token embeddings (or the given inputs_embeds) with the image features written into the placeholder
        positions, and the vision tower's output (None when no image was encoded). While decoding (something
        cached) placeholders need no pixel_values: the images are in the cache already."""
        if inputs_embeds is None:
            is_image = input_ids == self.config.image_token_id
            inputs_embeds = self.get_input_embeddings()(input_ids.masked_fill(is_image, 0))
            if pixel_values is None:
                # a check that reads values: eager only (a compiled decoding step cannot branch on them)
                if (
                    not torch.compiler.is_compiling()
                    and not _cached_length(past_key_values)
                    and (n_slots := int(is_image.sum()))
                ):
                    raise ValueError(
                        f"input_ids hold {n_slots} image placeholder tokens (id {self.config.image_token_id}) "
                        "but no pixel_values were given"
                    )
                return inputs_embeds, None
        elif pixel_values is None:
            return inputs_embeds, None
        mask = self.get_placeholder_mask(input_ids, inputs_embeds)
        if _cached_length(past_key_values) > 0 and not mask.any():  # decoding: the images are in the cache already
            return inputs_embeds, None
        if image_grid_thw is None:
            raise ValueError("pixel_values need image_grid_thw (one [t, h, w] row per image)")
        image_outputs = self.get_image_features(pixel_values, image_grid_thw)
        features = torch.cat(image_outputs.pooler_output)
        self._check_placeholder_count(mask, features, "input_ids" if input_ids is not None else "inputs_embeds")
        return inputs_embeds.masked_scatter(
            mask, features.to(inputs_embeds.device, inputs_embeds.dtype)
        ), image_outputs

    def keep_vision_in_graph(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """inputs_embeds [B, T, D] plus an exact 0 that depends on every trainable parameter of the vision tower and
        the projector, for a training step without images: they get a zero gradient instead of none. DDP's default
        (`find_unused_parameters=False`, what Trainer passes under gradient checkpointing and accelerate passes
        always) otherwise fails at the next step on a text-only batch ("Expected to have finished reduction in the
        prior iteration"); one process and FSDP2 get the same zero gradients, so all of them train alike. The rule:
        on text-only training steps the tower's gradient is 0 (as with the dense gradient buffers of Megatron /
        DeepSpeed), so an optimizer's weight decay and momentum still act on it; freeze it
        (`model.model.vision_tower.requires_grad_(False)`) to keep it fixed. Parameters sharded as DTensors outside
        their own module's forward (FSDP2 units inside the tower) are left out: FSDP handles unused parameters."""
        params = [
            p
            for module in (self.vision_tower, self.mm_projector)
            for p in module.parameters()
            # left out: sharded outside their own forward (FSDP2 DTensors, FSDP1 flat and DeepSpeed ZeRO-3
            # parameters), which their engines handle when unused
            if p.requires_grad
            and p.numel()
            and not (_is_dtensor(p) or getattr(p, "_is_flat_param", False) or hasattr(p, "ds_id"))
        ]
        if not params:
            return inputs_embeds
        # the sum of an empty slice: exactly 0 whatever the values (a NaN or inf weight stays out of the text), and
        # a zero gradient for every parameter
        zero = torch.stack([p.reshape(-1)[:0].sum().float().to(inputs_embeds.device) for p in params]).sum()
        return inputs_embeds + zero.to(inputs_embeds.device, inputs_embeds.dtype)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MultimodalMoeBaseModelOutputWithPast:
        """The text model's outputs plus `image_outputs`, the vision tower's BaseModelOutputWithPooling (pooler_output:
        one tensor of projected features per image) when images were encoded in this call."""
        past_key_values = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds")
        inputs_embeds, image_outputs = self.embed(
            input_ids, pixel_values, image_grid_thw, past_key_values, inputs_embeds=inputs_embeds
        )
        if image_outputs is None and self.training and torch.is_grad_enabled():
            inputs_embeds = self.keep_vision_in_graph(inputs_embeds)
        outputs = self.language_model(
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            **kwargs,
        )
        return MultimodalMoeBaseModelOutputWithPast(**outputs, image_outputs=image_outputs)


class KimiHybridForConditionalGeneration(KimiHybridMultimodalPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # as the text model (docs/parallelism.md)
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    model_class = KimiHybridModel

    def __init__(self, config: KimiHybridConfig):
        super().__init__(config)
        self.model = self.model_class(config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.LongTensor, **kwargs: Unpack[TransformersKwargs]
    ) -> tuple | BaseModelOutputWithPooling:
        return self.model.get_image_features(pixel_values, image_grid_thw, **kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MultimodalMoeCausalLMOutputWithPast:
        """As KimiHybridForCausalLM.forward, images written at the placeholders; `text_config.loss_chunk_size` set:
        a forward with labels returns the loss and `logits=None` (the head and the loss in chunks of tokens)."""
        text_config = self.config.text_config
        if output_router_logits is None:
            output_router_logits = text_config.output_router_logits
        outputs = self.model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        return lm_output(
            self,
            outputs,
            text_config,
            labels,
            attention_mask,
            logits_to_keep,
            output_router_logits,
            output_cls=MultimodalMoeCausalLMOutputWithPast,
            **kwargs,
        )


__all__ = ["KimiHybridModel", "KimiHybridForConditionalGeneration", "KimiHybridMultimodalPreTrainedModel"]
