"""What every converter reports while and after it runs: its memory and a progress bar. Standard library only
(tqdm is imported when a bar is shown): `kimi-hf convert NAME --help` and K3's checks stay free of torch.

Memory is read from Linux's /proc/self/status, whose VmHWM (the high-water mark of this process's resident set)
and VmRSS (the resident set now) count this program's own pages. Not getrusage's ru_maxrss: on Linux it keeps
the peak of the process image replaced by exec, i.e. the parent that forked the converter (a test runner's or a
notebook's gigabyte is reported as the converter's). Elsewhere ru_maxrss is the only figure there is.
"""

from __future__ import annotations

import sys


def _status_mb(field: str) -> float | None:
    """A memory line of /proc/self/status (e.g. "VmHWM:  123456 kB") in MB, or None where there is no /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:")) / 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB: Linux's VmHWM, else getrusage's ru_maxrss (see the
    module's docstring for why not ru_maxrss on Linux)."""
    peak = _status_mb("VmHWM")
    if peak is not None:
        return peak
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on the other Unixes


def rss_mb() -> float:
    """This process's resident memory now, in MB (Linux's VmRSS; elsewhere the peak so far)."""
    now = _status_mb("VmRSS")
    return peak_rss_mb() if now is None else now


class _NoBar:
    """The stand-in for a progress bar that is not shown: iterates like the bar would, updates do nothing."""

    def __init__(self, iterable=None):
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(iterable, total: int, desc: str, enabled: bool | None = True, unit: str = "layer"):
    """A tqdm bar on stderr over iterable (None: a bar advanced by `.update(n)`), counting `unit`s ("B": bytes,
    shown in KiB / MiB / GiB). enabled None: only when stderr is a terminal. Without tqdm (a dependency of
    transformers, so normally there), or disabled, a silent stand-in with the same iteration, update and close."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            enabled = False
    if not enabled:
        return _NoBar(iterable)
    scaled = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
    return tqdm(iterable, total=total, desc=desc, unit=unit, **scaled)


__all__ = ["peak_rss_mb", "progress", "rss_mb"]
