"""Distributed training of Kimi Linear and Kimi K3 on torch.distributed (docs/parallelism.md):

- `pipeline`: pipeline stages with Attention Residuals (`load_pipeline_stage`, `prune_to_stage`, `shard_stage`,
  `build_schedule`, `CausalLMLoss`), torch.distributed.pipelining's schedules;
- `parallel_dims`: the layout, every size and rule of it, and its device mesh (`ParallelDims`, `data_mesh`, ...);
- `parallelize`: this rank's model of a layout, with its groups (`parallelize`, `ParallelModel`, `init_distributed`);
- `train_step`: one step's forward and backward on any layout, the loss divided right (`train_step`);
- `clip`: gradient clipping by the whole model's norm on any layout (`clip_grad_norm`);
- `context`: context parallelism (`enable_context_parallel`, `context_parallel_batch`, ...);
- `checkpoint`: sharded torch.distributed.checkpoint save / resume (`TrainState`, `save_checkpoint`, ...);
- `export`: the trained model streamed from a checkpoint into K3's released layout (`export_lora`, `export_full`);
- `lora`: adapters initialised and averaged by name, the same on every layout (`init_lora_by_name`, ...).

Every public name of those modules is importable from here."""

import importlib as _importlib

from .checkpoint import *  # noqa: F403
from .clip import *  # noqa: F403
from .context import *  # noqa: F403
from .export import *  # noqa: F403
from .lora import *  # noqa: F403
from .parallel_dims import *  # noqa: F403
from .parallelize import *  # noqa: F403
from .pipeline import *  # noqa: F403
from .train_step import *  # noqa: F403


# (by name: `parallelize` and `train_step` are also the functions of those modules, exported here)
_NAMES = ("pipeline", "parallel_dims", "parallelize", "train_step", "clip", "context", "checkpoint", "export", "lora")
_MODULES = tuple(_importlib.import_module(f"{__name__}.{name}") for name in _NAMES)
__all__ = [name for module in _MODULES for name in module.__all__]
