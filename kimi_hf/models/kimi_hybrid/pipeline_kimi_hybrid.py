"""Pipeline stages of the hybrid decoder (Kimi Linear and Kimi K3), Block Attention Residuals included: which layers
a stage holds, pruning a model to its stage before its weights load, and one stage's forward. The schedules that
run the stages are torch.distributed.pipelining's (kimi_hf.distributed.pipeline builds them).

A stage holds a contiguous range of decoder layers; the first also the embedding (and a multimodal model's vision
tower and projector), the last the final depth attention (`final_res`), the norm and the head. Without Attention
Residuals a stage passes the hidden states [b, T, d] on; with them it passes the pair the layers themselves map
(`KimiHybridDecoderLayer.forward`): the current partial sum [b, T, d] and the completed depth blocks [n, b, T, d],
the embedding being block 0. A boundary inside a block (the next stage goes on adding to the partial sum) and on a
block edge (the next stage's first sublayer opens a new one) are therefore the same code as one process; n grows
along the pipeline. Parameter names stay the whole model's (`model.layers.7...`): optimizers, distributed
checkpoints and exports see the same names in every layout. See docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
from torch import nn

from ...ops.depth_attention import depth_blocks_after


_ACTIVE_STAGE: contextvars.ContextVar = contextvars.ContextVar("kimi_hf_pipeline_stage", default=None)


@dataclass(frozen=True)
class PipelineStageInfo:
    """Stage `index` of `num_stages`, holding the decoder layers `layers` (a range) of `num_layers`."""

    index: int
    num_stages: int
    layers: range
    num_layers: int

    @classmethod
    def split(cls, num_layers: int, index: int, num_stages: int, layers_per_stage=None) -> "PipelineStageInfo":
        """Stage `index` of a split of `num_layers` layers: `layers_per_stage` (one count a stage), or even (the first
        stages take one more when they do not divide, as transformers' pipeline does). ValueError for a stage
        without layers, counts that do not add up, or an index outside the pipeline."""
        ranges = stage_layer_ranges(num_layers, num_stages, layers_per_stage)
        if not isinstance(index, int) or not 0 <= index < num_stages:
            raise ValueError(f"pipeline stage index {index!r} is not in [0, {num_stages})")
        return cls(index, num_stages, ranges[index], num_layers)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_layer_ranges(num_layers: int, num_stages: int, layers_per_stage=None) -> list[range]:
    """The layers of each stage, in order."""
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"pp (the number of pipeline stages) must be a positive integer, got {num_stages!r}")
    if layers_per_stage is None:
        if num_stages > num_layers:
            raise ValueError(
                f"pp {num_stages} leaves a pipeline stage without layers: the model has {num_layers} decoder layers"
            )
        base, extra = divmod(num_layers, num_stages)
        layers_per_stage = [base + (i < extra) for i in range(num_stages)]
    counts = list(layers_per_stage)
    if len(counts) != num_stages or sum(counts) != num_layers or any(c < 1 for c in counts):
        raise ValueError(
            f"layers_per_stage {counts} must give each of the {num_stages} stages at least one layer and add up to "
            f"num_hidden_layers ({num_layers})"
        )
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


# ---- the model's parts ------------------------------------------------------------------------------------------
def decoder_of(model: nn.Module) -> nn.Module:
    """The text decoder (KimiHybridTextModel) of a causal LM, a multimodal model or a PEFT model around either."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def _top(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _placeholder() -> nn.Module:
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    return PipelineIdentityLayer()


def check_pipeline_model(model: nn.Module, stage: PipelineStageInfo) -> None:
    """ValueError for a model this pipeline cannot split: tied input / output embeddings (the first and the last
    stage would each hold a copy), a layer count other than the split's, or the router's auxiliary loss (a sum
    over every stage's routers)."""
    config = _top(model).config
    text = config.get_text_config()
    if stage.num_stages > 1 and (config.tie_word_embeddings or text.tie_word_embeddings):
        raise ValueError(
            "tie_word_embeddings: under pipeline parallelism the embedding (first stage) and the head (last stage) "
            "would be two copies of one weight; untie them (tie_word_embeddings=False) or use pp 1"
        )
    if text.num_hidden_layers != stage.num_layers:
        raise ValueError(
            f"the pipeline split is for {stage.num_layers} layers, the model has {text.num_hidden_layers}"
        )
    if text.output_router_logits and text.router_aux_loss_coef:
        raise ValueError(
            "output_router_logits with router_aux_loss_coef > 0 under pipeline parallelism: the auxiliary loss sums "
            "every stage's routers; use the auxiliary-loss-free balancing (kimi_hf.optim.ExpertBiasCallback)"
        )


def prune_to_stage(model: nn.Module, stage: PipelineStageInfo) -> nn.Module:
    """Replaces what another stage holds with parameter-free placeholders, in place: the other stages' decoder
    layers; off the first stage the embedding (and the vision tower / projector); off the last the final depth
    attention, the norm and the head. Returns the model, which records `stage` as `_kimi_pipeline_stage` and
    tells transformers' loader that the other stages' checkpoint tensors are expected to be left unread."""
    check_pipeline_model(model, stage)
    top, text = _top(model), decoder_of(model)
    multimodal = text is not top.model
    skipped = []
    layers_prefix = r"language_model\.layers" if multimodal else r"layers"
    others = [i for i in range(stage.num_layers) if i not in stage.layers]
    for i in others:
        text.layers[i] = _placeholder()
    if others:
        skipped.append(rf"(^|\.){layers_prefix}\.({'|'.join(map(str, others))})\.")
    if not stage.is_first:
        text.embed_tokens = _placeholder()
        skipped.append(r"(^|\.)embed_tokens\.")
        if multimodal:
            top.model.vision_tower, top.model.mm_projector = _placeholder(), _placeholder()
            skipped.append(r"(^|\.)(vision_tower|mm_projector)\.")
    if not stage.is_last:
        for name in ("norm", "final_res"):
            if hasattr(text, name):
                setattr(text, name, _placeholder())
        top.lm_head = _placeholder()
        skipped.append(r"(^|\.)(language_model\.)?(norm|final_res)\.|(^|\.)lm_head\.")
    top._keys_to_ignore_on_load_unexpected = set(top._keys_to_ignore_on_load_unexpected or ()) | set(skipped)
    top._kimi_pipeline_stage = stage
    return model


@contextlib.contextmanager
def loading_stage(stage: PipelineStageInfo):
    """Within it, the models' `maybe_distribute_model` (called by from_pretrained between building the model on
    the meta device and reading its tensors) prunes the model to `stage`."""
    token = _ACTIVE_STAGE.set(stage)
    try:
        yield
    finally:
        _ACTIVE_STAGE.reset(token)


def prune_to_active_stage(model: nn.Module) -> None:
    """prune_to_stage(model, the stage of the enclosing `loading_stage`), if any."""
    stage = _ACTIVE_STAGE.get()
    if stage is not None and getattr(_top(model), "_kimi_pipeline_stage", None) != stage:
        prune_to_stage(model, stage)


# ---- one stage's forward ----------------------------------------------------------------------------------------
def stage_io_meta(model: nn.Module, stage: PipelineStageInfo, micro_batch: int, seq_len: int):
    """(inputs, outputs) of `stage` for micro-batches of [micro_batch, seq_len] tokens, as meta tensors: what
    torch's PipelineStage sends and receives, given up front so that it runs no forward of its own to infer them
    (a forward on uninitialised tensors would count router loads and QK-Clip maxima). The first stage takes
    input_ids; a boundary carries the hidden states [b, T, d] and, with Attention Residuals, the completed
    blocks [n, b, T, d] (n from `depth_blocks_after`); the last stage returns the logits [b, T, V]."""
    top, text = _top(model), decoder_of(model)
    config = text.config
    dtype = text.layers[stage.layers[0]].input_layernorm.weight.dtype
    block_size = config.resolved_attn_residual_block_size()
    b, t, d = micro_batch, seq_len, config.hidden_size

    def boundary(layers_done: int):  # requires_grad: the gradients flow back across it
        hidden = torch.empty(b, t, d, dtype=dtype, device="meta", requires_grad=True)
        if block_size is None:
            return (hidden,)
        n = depth_blocks_after(2 * layers_done, block_size)
        return hidden, torch.empty(n, b, t, d, dtype=dtype, device="meta", requires_grad=True)

    inputs = (torch.empty(b, t, dtype=torch.long, device="meta"),) if stage.is_first else boundary(stage.layers.start)
    if stage.is_last:
        outputs = (
            torch.empty(b, t, config.vocab_size, dtype=top.lm_head.weight.dtype, device="meta", requires_grad=True),
        )
    else:
        outputs = boundary(stage.layers.stop)
    return inputs, outputs


class KimiPipelineStageModule(nn.Module):
    """The forward of one stage, over the (pruned) model it wraps.

    First stage: input_ids [b, T] -> the embedding (a multimodal model: its text embedding, the vision tower kept
    in the graph with a zero as in one process). Middle stages: hidden states [b, T, d] (and, with Attention
    Residuals, the completed blocks [n, b, T, d]). Every stage runs its layers on masks and positions built from
    its input's shape (or `position_ids`, a keyword every rank passes for packed documents); the last returns the
    logits [b, T, V]."""

    def __init__(self, model: nn.Module, stage: PipelineStageInfo):
        super().__init__()
        self.model = model
        self.stage = stage

    def forward(self, *inputs: torch.Tensor, position_ids: torch.Tensor | None = None):
        top, text = _top(self.model), decoder_of(self.model)
        if self.stage.is_first:
            (input_ids,) = inputs
            if text is top.model:
                hidden = text.embed_tokens(input_ids)
            else:
                hidden, _ = top.model.embed(input_ids, None, None, None)
                if self.training and torch.is_grad_enabled():
                    hidden = top.model.keep_vision_in_graph(hidden)
            blocks = text.start_blocks(hidden)
        else:
            hidden, blocks = inputs if len(inputs) == 2 else (inputs[0], None)
        position_ids, packed = text.positions(hidden, position_ids)
        masks = text.layer_masks(hidden, None, position_ids, None, packed)
        hidden, blocks = text.run_layers(hidden, blocks, self.stage.layers, masks, position_ids, None, packed)
        if not self.stage.is_last:
            return hidden if blocks is None else (hidden, blocks)
        if blocks is not None:
            hidden = text.final_res(blocks, hidden)
        return top.lm_head(text.norm(hidden))


__all__ = [
    "KimiPipelineStageModule",
    "PipelineStageInfo",
    "check_pipeline_model",
    "decoder_of",
    "loading_stage",
    "prune_to_active_stage",
    "prune_to_stage",
    "stage_io_meta",
    "stage_layer_ranges",
]
