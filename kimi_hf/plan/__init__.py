"""The memory planner behind `kimi-hf plan`: per-rank bytes of a Kimi K3 / Kimi Linear job for a parallel layout,
from the config alone (see planner.py). The planner (torch) is imported on first use, so `kimi-hf plan --help` and
its flag errors stay instant."""

from .layout import Layout, check_layout, parse_bytes


_LAZY = {"MemoryPlan", "Planner", "load_config"}


def __getattr__(name):
    if name in _LAZY:
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Layout", "MemoryPlan", "Planner", "check_layout", "load_config", "parse_bytes"]
