"""The argparse pieces the `kimi-hf` command (kimi_hf.cli) and the converters' command lines (kimi_hf.conversion.cli)
share. A leaf: it imports neither command line, so each can import it without importing the other.
"""

from __future__ import annotations

import argparse
import math
import os

from .sizes import parse_size


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (`PROG: error: ...`, exit status 2) that point to --help."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def size(text: str) -> int:
    """argparse type of a size in bytes (--max-shard-size, --gpu-memory): '5GB' (10^9), '5GiB' (2^30), '500MB' or a
    number of bytes (`kimi_hf.sizes`, transformers' convention); argparse names the flag in the error."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def layer_count(text: str) -> int:
    """argparse type of --verify-layers (every converter's): 0 (all layers) or N > 0 (the first N)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"invalid number of layers {text!r} (0: all, N: the first N)")
    return n


def check_positive(args, *names: str, number: str = "integer") -> None:
    """ValueError `--NAME must be a positive <number>, got V` for the first of `args.<name>` (argparse's names, `_`
    for `-`) that is not a finite number above 0: the scripts' checks of their counts and rates before any work."""
    for name in names:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive {number}, got {value}")


def check_output_folder(path: str | None, flag: str = "--out") -> None:
    """NotADirectoryError when an output folder to be made is an existing file (None: no output asked for)."""
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{flag} {path!r} is a file, not a folder")


def one_line(error: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


PRINTER_GRACE_S = 30  # how long the silent ranks of a refusal wait for the printing one (then exit all the same)


def refuse(error: BaseException, prog: str, printer: str | None = None):
    """A launched job's refusal: one line `PROG: error: ...` on stderr, exit status 2. printer: for a refusal that
    every rank makes alike, the environment variable ("RANK", "LOCAL_RANK") whose rank 0 alone prints it; the other
    ranks first wait (the printing one's exit ends them sooner), as torchrun stops every rank once one has failed,
    the printing one too if it had not printed yet. KIMI_HF_TRACEBACK=1: the traceback instead (as `kimi-hf`)."""
    import sys

    if os.environ.get("KIMI_HF_TRACEBACK"):
        raise error
    if printer is None or os.environ.get(printer, "0") == "0":
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
    else:
        import time

        time.sleep(PRINTER_GRACE_S)
    raise SystemExit(2) from None


__all__ = ["ArgumentParser", "check_output_folder", "check_positive", "layer_count", "one_line", "refuse", "size"]
