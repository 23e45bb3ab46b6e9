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

    @classmethod
    def interleaved(
        cls, num_layers: int, rank: int, pp: int, per_rank: int, layers_per_stage=None
    ) -> tuple["PipelineStageInfo", ...]:
        """The `per_rank` stages pipeline rank `rank` of `pp` holds in an interleaved split of `num_layers` layers
        into pp x per_rank stages (torch's interleaved schedules: rank r holds stages r, r + pp, r + 2 pp, ...)."""
        if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
            raise ValueError(f"stages a rank (per_rank) must be a positive integer, got {per_rank!r}")
        if not isinstance(rank, int) or not 0 <= rank < pp:
            raise ValueError(f"pipeline rank {rank!r} is not in [0, {pp})")
        return tuple(cls.split(num_layers, rank + i * pp, pp * per_rank, layers_per_stage) for i in range(per_rank))

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


def _as_stages(stage) -> tuple[PipelineStageInfo, ...]:
    """A stage, or the stages of one rank of an interleaved split (`PipelineStageInfo.interleaved`), as a tuple."""
    stages = stage if isinstance(stage, tuple) else (stage,)
    if not stages or not all(isinstance(s, PipelineStageInfo) for s in stages):
        raise TypeError(f"stage must be a PipelineStageInfo or a tuple of them, got {stage!r}")
    if len({(s.num_stages, s.num_layers) for s in stages}) != 1 or len({s.index for s in stages}) != len(stages):
        raise ValueError(f"the stages of one rank must be distinct stages of one split, got {stages}")
    return stages


def prune_to_stage(model: nn.Module, stage) -> nn.Module:
    """Replaces what another stage holds with parameter-free placeholders, in place: the other stages' decoder
    layers; off the first stage the embedding (and the vision tower / projector); off the last the final depth
    attention, the norm and the head. `stage` may be a tuple: the stages one rank holds in an interleaved split
    (`PipelineStageInfo.interleaved`). Returns the model, which records `stage` as `_kimi_pipeline_stage` and
    tells transformers' loader that the other stages' checkpoint tensors are expected to be left unread."""
    stages = _as_stages(stage)
    check_pipeline_model(model, stages[0])
    top, text = _top(model), decoder_of(model)
    multimodal = text is not top.model
    skipped = []
    layers_prefix = r"language_model\.layers" if multimodal else r"layers"
    held = {i for s in stages for i in s.layers}
    others = [i for i in range(stages[0].num_layers) if i not in held]
    for i in others:
        text.layers[i] = _placeholder()
    if others:
        skipped.append(rf"(^|\.){layers_prefix}\.({'|'.join(map(str, others))})\.")
    if not any(s.is_first for s in stages):
        text.embed_tokens = _placeholder()
        skipped.append(r"(^|\.)embed_tokens\.")
        if multimodal:
            top.model.vision_tower, top.model.mm_projector = _placeholder(), _placeholder()
            skipped.append(r"(^|\.)(vision_tower|mm_projector)\.")
    if not any(s.is_last for s in stages):
        for name in ("norm", "final_res"):
            if hasattr(text, name):
                setattr(text, name, _placeholder())
        top.lm_head = _placeholder()
        skipped.append(r"(^|\.)(language_model\.)?(norm|final_res)\.|(^|\.)lm_head\.")
    top._keys_to_ignore_on_load_unexpected = set(top._keys_to_ignore_on_load_unexpected or ()) | set(skipped)
    top._kimi_pipeline_stage = stage
    _drop_placeholder_rules(top)
    return model


@dataclass(frozen=True)
class _StageLoad:
    stage: PipelineStageInfo
    distributed_config: object | None  # a DistributedConfig of a stage's ranks (expert / tensor parallelism), or None


@contextlib.contextmanager
def loading_stage(stage: PipelineStageInfo, distributed_config=None):
    """Within it, the models' `maybe_distribute_model` (called by from_pretrained between building the model on
    the meta device and reading its tensors) prunes the model to `stage`. `distributed_config` (the one passed to
    from_pretrained: a transformers DistributedConfig with ep_size or tp_size > 1, its sizes those of a stage's ranks,
    pp_size 1) makes the load shard the stage over its own ranks (`prepare_stage_mesh`, `without_data_parallelism`)."""
    token = _ACTIVE_STAGE.set(_StageLoad(stage, distributed_config))
    try:
        yield
    finally:
        _ACTIVE_STAGE.reset(token)


def prune_to_active_stage(model: nn.Module) -> None:
    """prune_to_stage(model, the stage of the enclosing `loading_stage`), if any."""
    active = _ACTIVE_STAGE.get()
    if active is not None and getattr(_top(model), "_kimi_pipeline_stage", None) != active.stage:
        prune_to_stage(model, active.stage)


def _stage_config(distributed_config):
    """The active stage load, if `distributed_config` is the one it shards with."""
    active = _ACTIVE_STAGE.get()
    if active is None or active.distributed_config is None or distributed_config is not active.distributed_config:
        return None
    return active


def prepare_stage_mesh(distributed_config, device_map=None):
    """(distributed_config, device_map, mesh manager) for from_pretrained in a `loading_stage` with expert / tensor
    parallelism, else None (transformers prepares the load). transformers' meshes (dense: pp x dp_replicate x fsdp x
    tp; experts: pp x dp_replicate x efsdp x ep) are built over the whole world with the pipeline dimension added:
    a stage's ep and efsdp groups are then ranks of that stage. (DistributedConfig itself refuses pp_size > 1 with
    data parallelism or token dispatch: transformers' own pipeline is a forward-only one.)"""
    active = _stage_config(distributed_config)
    if active is None:
        return None
    import copy

    from transformers.distributed.utils import initialize_distributed_mesh

    with_stages = copy.copy(distributed_config)
    with_stages.pp_size = active.stage.num_stages
    mapped, manager = initialize_distributed_mesh(with_stages)
    if manager.get_mesh("pp").get_local_rank() != active.stage.index:
        raise ValueError(
            f"pipeline stage {active.stage.index} loaded on the rank of stage {manager.get_mesh('pp').get_local_rank()}"
            " of the mesh (pp x dp_replicate x fsdp x tp, pp outermost)"
        )
    return distributed_config, device_map if device_map is not None else mapped, manager


def distribute_for_stage(distribute, model: nn.Module, distributed_config, mesh_manager) -> nn.Module:
    """transformers' `distribute(model, config, mesh_manager)` (the mixin's maybe_distribute_model) given
    `without_data_parallelism(distributed_config)`; the model then records the config it was loaded with (its
    data-parallel sizes are the stage's)."""
    model = distribute(model, without_data_parallelism(distributed_config), mesh_manager)
    if mesh_manager is not None:
        model.config.distributed_config = distributed_config
    return model


def _drop_placeholder_rules(model: nn.Module) -> None:
    """Removes the TP / EP rules that name a module another stage holds (`lm_head`, `embed_tokens`: replaced by a
    parameter-free placeholder), which transformers would otherwise try to shard when the stage loads with
    tensor / expert parallelism."""
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
    from transformers.distributed.pipeline_parallel import PipelineIdentityLayer

    held, placeholders = set(), set()
    for name, module in model.named_modules():
        (placeholders if isinstance(module, PipelineIdentityLayer) else held).add(
            replace_layer_number_by_wildcard(name)
        )
    for attr in ("_tp_plan", "_ep_plan"):
        plan = getattr(model, attr, None)
        if plan:
            setattr(model, attr, {k: v for k, v in plan.items() if k not in placeholders or k in held})


def without_data_parallelism(distributed_config):
    """What transformers' maybe_distribute_model is given in a `loading_stage` with expert / tensor parallelism: the
    config with data parallelism off, so that it applies the EP (and TP) plans alone. FSDP2 of a stage is
    kimi_hf.distributed.pipeline.shard_stage's: transformers shards the model's root, whose forward a stage's
    (KimiPipelineStageModule) does not call. Elsewhere, the config itself."""
    if _stage_config(distributed_config) is None:
        return distributed_config
    import copy

    inside = copy.copy(distributed_config)
    inside.fsdp_size = inside.dp_replicate_size = 1
    return inside


# ---- one stage's forward ----------------------------------------------------------------------------------------
def stage_io_meta(model: nn.Module, stage: PipelineStageInfo, micro_batch: int, seq_len: int):
    """(inputs, outputs) of `stage` for micro-batches of [micro_batch, seq_len] tokens, as meta tensors: what
    torch's PipelineStage sends and receives, given up front so that it runs no forward of its own to infer them
    (a forward on uninitialised tensors would count router loads and QK-Clip maxima). The first stage takes
    input_ids; a boundary carries the hidden states [b, T, d] and, with Attention Residuals, the completed
    blocks [n, b, T, d] (n from `depth_blocks_after`); the last stage returns the logits [b, T, V], or with
    `loss_chunk_size` the normed hidden states [b, T, d] (KimiPipelineStageModule)."""
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
    if stage.is_last and config.loss_chunk_size is not None:  # the head runs in the loss (CausalLMLoss(head=))
        hidden_dtype = torch.promote_types(dtype, text.norm.weight.dtype)
        outputs = (torch.empty(b, t, d, dtype=hidden_dtype, device="meta", requires_grad=True),)
    elif stage.is_last:
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
    logits [b, T, V], or, when the text config sets `loss_chunk_size`, the normed hidden states [b, T, d]: the loss
    function then applies the head chunk by chunk (kimi_hf.distributed.CausalLMLoss(..., head=lm_head,
    chunk_size=...)), the logits never whole. Under context parallelism (enable_context_parallel on the stage's model) T is this rank's
    slice of the sequences, and the positions are the slice's global ones (`context_positions`)."""

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
        context = None
        if text._context_parallel is not None:  # this rank's slice of the micro-batch's sequences
            position_ids, packed, masks, context = text.context_positions(hidden, position_ids)
        else:
            position_ids, packed = text.positions(hidden, position_ids)
            masks = text.layer_masks(hidden, None, position_ids, None, packed)
        hidden, blocks = text.run_layers(hidden, blocks, self.stage.layers, masks, position_ids, None, packed, context)
        if not self.stage.is_last:
            return hidden if blocks is None else (hidden, blocks)
        if blocks is not None:
            hidden = text.final_res(blocks, hidden)
        hidden = text.norm(hidden)
        if text.config.loss_chunk_size is not None:  # the loss function holds the head (chunked cross-entropy)
            return hidden
        return top.lm_head(hidden)


__all__ = [
    "KimiPipelineStageModule",
    "PipelineStageInfo",
    "check_pipeline_model",
    "decoder_of",
    "distribute_for_stage",
    "loading_stage",
    "prepare_stage_mesh",
    "prune_to_active_stage",
    "prune_to_stage",
    "stage_io_meta",
    "stage_layer_ranges",
    "without_data_parallelism",
]
