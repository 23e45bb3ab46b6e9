"""Atomic writes with normal permissions, the package's one place for them (models, conversion, plotting).

Files and directories are written through temporary ones and renamed, so that readers never see a partial
one, yet get the permissions open() / mkdir() would give them (0o666 / 0o777 & ~umask), not mkstemp's /
mkdtemp's private 0o600 / 0o700. Standard library only: saved model folders ship this file.
"""

from __future__ import annotations

import os
import tempfile
import threading


_UMASK_LOCK = threading.Lock()


# --------------------------------------------------------------------------------------------
def current_umask() -> int:
    """The process umask. Linux reports it in /proc/self/status; elsewhere it can only be read by
    setting it, so it is set and restored under a lock (other threads may still race with that)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def normal_mode(directory: bool = False) -> int:
    """The mode open() / mkdir() would give a new file (0o666) or directory (0o777) under the umask:
    mkstemp / mkdtemp create theirs private (0o600 / 0o700)."""
    return (0o777 if directory else 0o666) & ~current_umask()


def atomic_write(path: str, data: bytes | str) -> str:
    """Writes data (str as UTF-8) to path through a temporary file in the same directory and a
    rename, so that readers never see a partial file; the file gets `normal_mode()`. Returns path."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            os.fchmod(f.fileno(), normal_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def set_normal_mode(path: str) -> None:
    """Gives a file written by another library through a temporary file (safetensors >= 0.8 writes
    0o600 weights) the mode open() would have given it."""
    os.chmod(path, normal_mode(directory=os.path.isdir(path)))


def make_temp_dir(parent: str, prefix: str) -> str:
    """A new temporary directory in parent (to be renamed into place later) with `normal_mode(True)`."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(tmp, normal_mode(directory=True))
    return tmp


__all__ = ["atomic_write", "current_umask", "make_temp_dir", "normal_mode", "set_normal_mode"]
