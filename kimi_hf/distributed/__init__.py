"""Distributed training of Kimi Linear and Kimi K3 on torch.distributed (docs/parallelism.md):

- `pipeline`: pipeline stages with Attention Residuals (`load_pipeline_stage`, `prune_to_stage`, `shard_stage`,
  `build_schedule`, `CausalLMLoss`), torch.distributed.pipelining's schedules;
- `mesh`: a training layout's checks and device mesh (`TrainingLayout`, `data_mesh`, `data_rank`);
- `context`: context parallelism (`enable_context_parallel`, `context_parallel_batch`, ...);
- `checkpoint`: sharded torch.distributed.checkpoint save / resume (`TrainState`, `save_checkpoint`, ...);
- `export`: the trained model streamed from a checkpoint into K3's released layout (`export_lora`, `export_full`);
- `lora`: adapters initialised and averaged by name, the same on every layout (`init_lora_by_name`, ...).

Every public name of those modules is importable from here; each module loads on first use (PEP 562)."""

import importlib


_MODULES = ("pipeline", "mesh", "context", "checkpoint", "export", "lora")
_EXPORTS = {
    # pipeline
    **dict.fromkeys(
        (
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
        ),
        "pipeline",
    ),
    **dict.fromkeys(("TrainingLayout", "data_mesh", "data_rank"), "mesh"),
    **dict.fromkeys(
        (
            "context_parallel_batch",
            "context_parallel_group",
            "disable_context_parallel",
            "enable_context_parallel",
            "shard_sequence",
        ),
        "context",
    ),
    **dict.fromkeys(("TrainState", "checkpoint_steps", "load_checkpoint", "save_checkpoint"), "checkpoint"),
    **dict.fromkeys(("check_export_dir", "export_full", "export_lora", "lora_factors"), "export"),
    **dict.fromkeys(("average_unsharded_grads", "init_lora_by_name"), "lora"),
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__():
    return sorted([*globals(), *__all__])
