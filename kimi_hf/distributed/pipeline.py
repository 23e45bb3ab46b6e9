"""Pipeline parallelism of Kimi Linear and Kimi K3 on `torch.distributed.pipelining`, Block Attention Residuals
included (the stage boundary carries the partial sum and the completed depth blocks: pipeline_kimi_hybrid.py).

    stage = PipelineStageInfo.split(num_layers, pp_rank, pp_size)
    model = load_pipeline_stage(AutoModelForCausalLM, path, stage)   # reads only this stage's tensors
    schedule = build_schedule(model, stage, pp_group, n_microbatches=4, loss_fn=CausalLMLoss(vocab_size, n_tokens))
    schedule.step(input_ids) / schedule.step() / schedule.step(target=labels, losses=losses)   # first / middle / last

See docs/parallelism.md.
"""

from __future__ import annotations

import torch
from torch import nn

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


SCHEDULES = ("gpipe", "1f1b")


def load_pipeline_stage(model_class, path, stage: PipelineStageInfo, **kwargs) -> nn.Module:
    """`model_class.from_pretrained(path, **kwargs)` holding only `stage`'s part: the model is built on the meta
    device, pruned to the stage (`prune_to_stage`) and then loaded, so a rank reads and allocates its stage's
    tensors only (the released K3 layout and its MXFP4 experts as in a whole load). `output_loading_info=True`
    returns (model, loading info) as from_pretrained does: the other stages' tensors are neither missing nor
    unexpected."""
    from transformers.distributed import DistributedConfig

    if "distributed_config" in kwargs or "tp_plan" in kwargs:
        raise ValueError(
            "load_pipeline_stage does not take distributed_config / tp_plan: shard the stage after loading "
            "(kimi_hf.distributed.parallelize)"
        )
    with loading_stage(stage):
        # an all-1 DistributedConfig builds no mesh but makes from_pretrained call maybe_distribute_model, where
        # the models prune themselves to the active stage before any tensor is read
        loaded = model_class.from_pretrained(path, distributed_config=DistributedConfig(), **kwargs)
    model = loaded[0] if kwargs.get("output_loading_info") else loaded
    if getattr(_top(model), "_kimi_pipeline_stage", None) != stage:
        raise TypeError(f"{type(model).__name__} is not a kimi_hf hybrid model: it cannot load one pipeline stage")
    return loaded


class CausalLMLoss:
    """The loss the last stage computes per micro-batch: the shifted cross-entropy summed over the micro-batch's
    tokens and divided by `num_items`, the label tokens (not -100) of the whole step (all micro-batches, all data
    ranks) over `grad_divide` (what data parallelism divides the summed gradients by: FSDP2 averages them). The
    micro-batches' losses then add up to one process's mean loss of the step, and the schedule must not scale
    the gradients again (`scale_grads=False`)."""

    def __init__(self, vocab_size: int, num_items: int = 1, grad_divide: int = 1):
        self.vocab_size, self.num_items, self.grad_divide = vocab_size, num_items, grad_divide

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """labels [B, T] (shifted here), or shift_labels [B, T] already shifted (context parallelism: a rank's slice
        of labels shifted before the split)."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(
            logits,
            labels,
            self.vocab_size,
            num_items_in_batch=self.num_items / self.grad_divide,
            shift_labels=shift_labels,
        )


def build_schedule(
    model: nn.Module,
    stage: PipelineStageInfo,
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
    CausalLMLoss)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    if schedule == "1f1b" and n_microbatches < stage.num_stages:
        raise ValueError(
            f"the 1F1B schedule needs at least as many micro-batches as stages: n_microbatches {n_microbatches} < "
            f"pp {stage.num_stages}"
        )
    if device is None:
        device = next(model.parameters()).device
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
    "decoder_of",
    "load_pipeline_stage",
    "prune_to_stage",
    "stage_layer_ranges",
]
