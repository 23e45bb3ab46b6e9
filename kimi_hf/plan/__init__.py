"""The memory planner behind `kimi-hf plan`: per-rank bytes of a Kimi K3 / Kimi Linear job for a parallel layout,
from the config alone (see planner.py). The planner (torch) is imported on first use, so `kimi-hf plan --help` and
its flag errors stay instant."""

from ..sizes import parse_size as parse_bytes  # its name here before kimi_hf.sizes held the one size parser
from .layout import Layout, check_layout


_LAZY = {"MemoryPlan", "Planner", "load_config"}


def __getattr__(name):
    if name in _LAZY:
        from . import planner

        return getattr(planner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Layout", "MemoryPlan", "Planner", "check_layout", "load_config", "parse_bytes"]
