"""Pipeline parallelism of Kimi Linear and Kimi K3 on `torch.distributed.pipelining`, Block Attention Residuals
included (the stage boundary carries the partial sum and the completed depth blocks: pipeline_kimi_hybrid.py).

    stage = PipelineStageInfo.split(num_layers, pp_rank, pp_size)
    model = load_pipeline_stage(AutoModelForCausalLM, path, stage)   # reads only this stage's tensors
    module = shard_stage(model, stage, data_mesh)                      # FSDP2 over the stage's data ranks
    schedule = build_schedule(module, stage, pp_group, n_microbatches=4, loss_fn=CausalLMLoss(vocab_size, n_tokens))
    schedule.step(input_ids) / schedule.step() / schedule.step(target=labels, losses=losses)   # first / middle / last

See docs/parallelism.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.kimi_hybrid.modeling_kimi_hybrid import _RoutedExperts
from ..models.kimi_hybrid.pipeline_kimi_hybrid import (
    KimiPipelineStageModule,
    PipelineStageInfo,
    _top,
    check_pipeline_model,
    decoder_of,
    loading_stage,
    prune_to_stage,
    stage_io_meta,
    stage_layer_ranges,
)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def load_pipeline_stage(model_class, path, stage, distributed_config=None, **kwargs) -> nn.Module:
    """`model_class.from_pretrained(path, **kwargs)` holding only `stage`'s part (a PipelineStageInfo, or the tuple
    of a rank's stages of an interleaved split, `PipelineStageInfo.interleaved`): the model is built on the meta
    device, pruned to the stage (`prune_to_stage`) and then loaded, so a rank reads and allocates its stage's
    tensors only (the released K3 layout and its MXFP4 experts as in a whole load). `output_loading_info=True`
    returns (model, loading info) as from_pretrained does: the other stages' tensors are neither missing nor
    unexpected.

    `distributed_config`, a transformers DistributedConfig of one stage's ranks (pp_size 1: the pipeline's is the
    split's), shards the stage as it loads, each rank reading its part only:
    - DistributedConfig(ep_size=E, fsdp_size=F, dp_replicate_size=R) (F x R = world / pp: the stage's data ranks):
      expert parallelism, num_experts / E whole experts of the stage's layers a rank, exchanged by transformers'
      token dispatch over E of the stage's ranks; FSDP2 of the rest is `shard_stage`'s, after the load (and LoRA);
    - DistributedConfig(tp_size=T[, ep_size=T]) (T = world / pp): tensor parallelism inside the stage (transformers'
      TP plan: heads, intermediate widths; with ep_size the experts whole over the same ranks); the stage's ranks are
      its tensor-parallel ranks (no data parallelism inside a stage with TP in this version)."""
    from transformers.distributed import DistributedConfig

    if "tp_plan" in kwargs:
        raise ValueError(
            "load_pipeline_stage does not take tp_plan: pass distributed_config=DistributedConfig(tp_size=)"
        )
    if distributed_config is not None:
        check_stage_config(distributed_config)
        if isinstance(stage, tuple):
            raise ValueError(
                "distributed_config with interleaved stages (a tuple of stages): interleaved schedules run without "
                "expert / tensor / data parallelism inside the stages in this version"
            )
    else:
        # an all-1 DistributedConfig builds no mesh but makes from_pretrained call maybe_distribute_model, where
        # the models prune themselves to the active stage before any tensor is read
        distributed_config = DistributedConfig()
    sharded = distributed_config.ep_size > 1 or distributed_config.tp_size > 1
    with loading_stage(stage, distributed_config if sharded else None):
        loaded = model_class.from_pretrained(path, distributed_config=distributed_config, **kwargs)
    model = loaded[0] if kwargs.get("output_loading_info") else loaded
    if getattr(_top(model), "_kimi_pipeline_stage", None) != stage:
        raise TypeError(f"{type(model).__name__} is not a kimi_hf hybrid model: it cannot load one pipeline stage")
    return loaded


def check_stage_config(distributed_config) -> None:
    """TypeError / ValueError (naming the field) for a DistributedConfig that `load_pipeline_stage` does not take."""
    from transformers.distributed import DistributedConfig

    if not isinstance(distributed_config, DistributedConfig):
        raise TypeError(
            f"distributed_config must be a transformers DistributedConfig, got {type(distributed_config).__name__}"
        )
    if distributed_config.pp_size != 1:
        raise ValueError(
            f"distributed_config.pp_size {distributed_config.pp_size}: a stage's config gives the sizes inside a stage "
            "(the pipeline's is the split's)"
        )
    tp, ep, data = distributed_config.tp_size, distributed_config.ep_size, distributed_config.dp_size
    if tp == 1 and ep == 1:
        raise ValueError(
            "distributed_config with neither ep_size nor tp_size > 1: a stage then loads whole (pass none); FSDP2 of a "
            "stage is shard_stage's"
        )
    if tp > 1 and data > 1:
        raise ValueError(
            f"distributed_config.tp_size {tp} with fsdp_size x dp_replicate_size {data}: tensor parallelism inside a "
            "pipeline stage runs without data parallelism in this version"
        )


def shard_stage(model: nn.Module, stage: PipelineStageInfo, mesh) -> KimiPipelineStageModule:
    """FSDP2 (torch's fully_shard) of one stage over its data ranks, `mesh` (a 1-D mesh, or 2-D dp_replicate x fsdp
    for HSDP: `kimi_hf.distributed.parallel_dims.data_mesh`); returns the KimiPipelineStageModule to build the schedule on.
    Call it after LoRA (the adapters are sharded with their layers).

    A stage loaded with expert parallelism first has its experts sharded over the ranks that hold the same experts
    (transformers' efsdp mesh), as transformers' own FSDP2 of an EP model does: their gradients sum the tokens of
    every data rank of the stage (the token dispatch brought them), so they are divided by the data ranks' count
    rather than efsdp's. Then each decoder layer, then the stage module, the root: the schedule calls its forward."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    top, module = _top(model), KimiPipelineStageModule(model, stage)
    manager = getattr(top, "_mesh_manager", None)
    config = getattr(top.config, "distributed_config", None)
    if manager is not None and config is not None and config.ep_size > 1:
        replicated = config.dp_replicate_size > 1
        expert_mesh = manager.get_mesh(("dp_replicate", "efsdp") if replicated else "efsdp")
        for sub in model.modules():
            if isinstance(sub, _RoutedExperts) and any(isinstance(p, DTensor) for p in sub.parameters(recurse=False)):
                fully_shard(sub, mesh=expert_mesh, reshard_after_forward=True)
                sub.set_gradient_divide_factor(float(config.dp_size))
                if config.efsdp_size > 1:  # a divide factor other than the group's, applied locally after a sum
                    sub.set_force_sum_reduction_for_comms(True)
    decoder = decoder_of(model)
    for i in stage.layers:
        fully_shard(decoder.layers[i], mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


class CausalLMLoss:
    """The loss the last stage computes per micro-batch: the shifted cross-entropy summed over the micro-batch's
    tokens and divided by `num_items`, the label tokens (not -100) of the whole step (all micro-batches, all data
    ranks) over `grad_divide` (what data parallelism divides the summed gradients by: FSDP2 averages them). The
    micro-batches' losses then add up to one process's mean loss of the step, and the schedule must not scale
    the gradients again (`scale_grads=False`). `shifted=True`: the labels a schedule passes are already shifted
    (context parallelism: a rank's slice of labels shifted before the split, `context_parallel_batch`).

    `head` and `chunk_size` (a model whose text config sets `loss_chunk_size`: its last stage returns the normed
    hidden states [b, T, d] instead of the logits, KimiPipelineStageModule): the loss applies the stage's `lm_head`
    itself, `chunk_size` tokens at a time (kimi_hf.ops.chunked_causal_lm_loss, the same loss and gradients), so the
    last stage never holds a micro-batch's whole logits:

        text = model.config.get_text_config()
        loss_fn = CausalLMLoss(text.vocab_size, grad_divide=dp, head=model.lm_head, chunk_size=text.loss_chunk_size)
    """

    def __init__(
        self,
        vocab_size: int,
        num_items: int = 1,
        grad_divide: int = 1,
        shifted: bool = False,
        head: nn.Module | None = None,
        chunk_size: int | None = None,
    ):
        if (head is None) != (chunk_size is None):
            raise ValueError(
                "CausalLMLoss takes head and chunk_size together (the chunked loss on the last stage's hidden "
                f"states) or neither (the loss on its logits); got head={type(head).__name__}, chunk_size={chunk_size!r}"
            )
        if chunk_size is not None:
            from ..ops.chunked_cross_entropy import check_chunk_size

            check_chunk_size(chunk_size)
        self.vocab_size, self.num_items, self.grad_divide = vocab_size, num_items, grad_divide
        self.shifted = shifted
        self.head, self.chunk_size = head, chunk_size

    @property
    def num_items_in_batch(self) -> float:
        """transformers' `num_items_in_batch` of this loss: the step's label tokens over `grad_divide`."""
        return self.num_items / self.grad_divide

    def __call__(
        self, output: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """output: the last stage's logits [B, T, V] (or its hidden states [B, T, d] with `head`); labels [B, T]
        (shifted here), or shift_labels [B, T] already shifted (context parallelism: a rank's slice of labels
        shifted before the split)."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        from ..ops.chunked_cross_entropy import chunked_causal_lm_loss

        if self.shifted and shift_labels is None:
            labels, shift_labels = None, labels
        num_items = self.num_items_in_batch
        if self.head is None:
            if output.shape[-1] != self.vocab_size:
                raise ValueError(
                    f"the last stage returned [..., {output.shape[-1]}], not logits over {self.vocab_size} tokens: a "
                    "model with loss_chunk_size returns its hidden states; pass CausalLMLoss(head=model.lm_head, "
                    "chunk_size=text_config.loss_chunk_size)"
                )
            return ForCausalLMLoss(
                output, labels, self.vocab_size, num_items_in_batch=num_items, shift_labels=shift_labels
            )
        return chunked_causal_lm_loss(
            output,
            self.head,
            labels,
            chunk_size=self.chunk_size,
            num_items_in_batch=num_items,
            shift_labels=shift_labels,
        )


def build_schedule(
    model: nn.Module,
    stage,
    group,
    n_microbatches: int,
    loss_fn,
    schedule: str = "1f1b",
    *,
    micro_batch: int,
    seq_len: int,
    device: torch.device | str | None = None,
):
    """A torch.distributed.pipelining schedule ("gpipe": ScheduleGPipe, "1f1b": Schedule1F1B) running `model`'s
    stage (a KimiPipelineStageModule around it, or that module, e.g. after fully_shard) in the process group
    `group` (the pipeline dimension of the mesh), on micro-batches of [micro_batch, seq_len] tokens (the stage
    boundaries' shapes: `stage_io_meta`). Gradients are not scaled by the schedule: `loss_fn` normalises (see
    CausalLMLoss).

    "interleaved_1f1b" (ScheduleInterleaved1F1B) takes `stage` as the tuple of stages this rank holds
    (`PipelineStageInfo.interleaved`: rank r holds stages r, r + pp, ...; the model pruned to all of them), one
    torch PipelineStage each: a smaller bubble for more boundary transfers. Without data parallelism in this
    version (each stage a module of its own around the one model)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    if (schedule == "interleaved_1f1b") != isinstance(stage, tuple):
        raise ValueError(
            "the interleaved_1f1b schedule takes the tuple of a rank's stages (PipelineStageInfo.interleaved), the "
            f"other schedules one stage; got schedule {schedule!r} with stage {stage!r}"
        )
    if device is None:
        device = next(model.parameters()).device
    if schedule == "interleaved_1f1b":
        pp = stage[0].num_stages // len(stage)
        if n_microbatches % pp:
            raise ValueError(
                f"the interleaved 1F1B schedule needs micro-batches in multiples of pp: n_microbatches "
                f"{n_microbatches}, pp {pp}"
            )
        if isinstance(model, KimiPipelineStageModule):
            raise TypeError("the interleaved schedule takes the (pruned) model itself: it builds a module a stage")
        pipe_stages = []
        for s in stage:
            inputs, outputs = stage_io_meta(model, s, micro_batch, seq_len)
            module = KimiPipelineStageModule(model, s)
            pipe_stages.append(
                PipelineStage(module, s.index, s.num_stages, torch.device(device), inputs, outputs, group=group)
            )
        return ScheduleInterleaved1F1B(pipe_stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if schedule == "1f1b" and n_microbatches < stage.num_stages:
        raise ValueError(
            f"the 1F1B schedule needs at least as many micro-batches as stages: n_microbatches {n_microbatches} < "
            f"pp {stage.num_stages}"
        )
    module = model if isinstance(model, KimiPipelineStageModule) else KimiPipelineStageModule(model, stage)
    inputs, outputs = stage_io_meta(module.model, stage, micro_batch, seq_len)
    pipe_stage = PipelineStage(
        module, stage.index, stage.num_stages, torch.device(device), inputs, outputs, group=group
    )
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    return cls(pipe_stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)


__all__ = [
    "SCHEDULES",
    "CausalLMLoss",
    "KimiPipelineStageModule",
    "PipelineStageInfo",
    "build_schedule",
    "check_pipeline_model",
    "check_stage_config",
    "decoder_of",
    "load_pipeline_stage",
    "prune_to_stage",
    "shard_stage",
    "stage_layer_ranges",
]
