"""Every converter's atomic output folder: built in a temporary directory next to DST, renamed into place at the end.

    with output_dir(dst, ".convert-") as tmp:   # a hidden directory beside dst, with mkdir's normal mode
        ...write the files into tmp...          # an exception (or Ctrl-C) removes tmp: dst is never half written
                                                # leaving the block renames tmp to dst (`install`)

Files written into tmp are expected to get normal modes (open()'s, 0o644 under umask 022: `atomic_io`
`set_normal_mode` / `atomic_write`, shutil.copyfile); the folder itself gets mkdir's (0o755), not mkdtemp's 0o700.

What may stand at dst is the caller's rule, checked before any work (kimi-linear and k25-vision: nothing;
k3: nothing or an empty directory, or anything with --overwrite). `install` then only ever replaces what that
rule allowed: without overwrite a rename, which replaces an empty directory and fails on anything else (a
folder that appeared at dst meanwhile is never deleted).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid

from ..atomic_io import make_temp_dir


def make_output_dir(dst: str, prefix: str) -> str:
    """A new temporary directory beside dst (same file system, so that the final rename is atomic), hidden by
    prefix (".convert-..."), with mkdir's normal mode."""
    return make_temp_dir(os.path.dirname(os.path.abspath(dst)), prefix)


def install(tmp: str, dst: str, overwrite: bool = False) -> None:
    """Renames the finished folder tmp to dst. dst absent or an empty directory: one rename (which replaces the
    empty directory). Otherwise, with overwrite, the old dst is moved aside, tmp renamed to dst, then the old one
    deleted (put back if the rename fails); without overwrite the rename fails as the OS refuses it."""
    empty_dir = os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst)
    if not overwrite or not os.path.lexists(dst) or empty_dir:
        os.replace(tmp, dst)
        return
    old = os.path.join(os.path.dirname(os.path.abspath(dst)), f".{os.path.basename(dst)}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.unlink(old)


def discard(tmp: str) -> None:
    """Removes an unfinished temporary folder and everything in it."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def output_dir(dst: str, prefix: str, overwrite: bool = False):
    """Yields a temporary folder (`make_output_dir`) that becomes dst when the block ends (`install`); an
    exception in the block, or in the install, removes it instead and propagates."""
    tmp = make_output_dir(dst, prefix)
    try:
        yield tmp
        install(tmp, dst, overwrite)
    except BaseException:
        discard(tmp)
        raise


__all__ = ["discard", "install", "make_output_dir", "output_dir"]
