"""Distributed training of Kimi Linear and Kimi K3 on torch.distributed (docs/parallelism.md):

- `pipeline`: pipeline stages with Attention Residuals (`load_pipeline_stage`, `prune_to_stage`, `shard_stage`,
  `build_schedule`, `CausalLMLoss`), torch.distributed.pipelining's schedules;
- `mesh`: a training layout's checks and device mesh (`TrainingLayout`, `data_mesh`, `data_rank`);
- `context`: context parallelism (`enable_context_parallel`, `context_parallel_batch`, ...);
- `checkpoint`: sharded torch.distributed.checkpoint save / resume (`TrainState`, `save_checkpoint`, ...);
- `export`: the trained model streamed from a checkpoint into K3's released layout (`export_lora`, `export_full`);
- `lora`: adapters initialised and averaged by name, the same on every layout (`init_lora_by_name`, ...).

Every public name of those modules is importable from here."""

from . import checkpoint, context, export, lora, mesh, pipeline
from .checkpoint import *  # noqa: F403
from .context import *  # noqa: F403
from .export import *  # noqa: F403
from .lora import *  # noqa: F403
from .mesh import *  # noqa: F403
from .pipeline import *  # noqa: F403


_MODULES = (pipeline, mesh, context, checkpoint, export, lora)
__all__ = [name for module in _MODULES for name in module.__all__]
