"""Distributed training of Kimi Linear and Kimi K3 on torch.distributed: pipeline stages with Attention Residuals
(`pipeline`), the device mesh of a layout (`mesh`), sharded checkpoints (`checkpoint`), the trained model exported in
K3's released layout from them (`export`). See docs/parallelism.md."""

from .pipeline import (
    SCHEDULES,
    CausalLMLoss,
    KimiPipelineStageModule,
    PipelineStageInfo,
    build_schedule,
    load_pipeline_stage,
    prune_to_stage,
    shard_stage,
    stage_layer_ranges,
)


__all__ = [
    "SCHEDULES",
    "CausalLMLoss",
    "KimiPipelineStageModule",
    "PipelineStageInfo",
    "build_schedule",
    "load_pipeline_stage",
    "prune_to_stage",
    "shard_stage",
    "stage_layer_ranges",
]
