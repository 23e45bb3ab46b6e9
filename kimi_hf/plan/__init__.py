"""The memory planner behind `kimi-hf plan`: per-rank bytes of a Kimi K3 / Kimi Linear job for a parallel layout,
from the config alone (see planner.py). The planner (torch) is imported on first use, so `kimi-hf plan --help` and
its flag errors stay instant. The layout a plan takes is the trainer's: `kimi_hf.distributed.ParallelDims`."""

from ..sizes import parse_size as parse_bytes  # its name here before kimi_hf.sizes held the one size parser


_LAZY = {"MemoryPlan", "Planner", "load_config"}


def __getattr__(name):
    if name in _LAZY:
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MemoryPlan", "Planner", "load_config", "parse_bytes"]
