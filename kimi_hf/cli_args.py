"""The argparse pieces the `kimi-hf` command (kimi_hf.cli) and the converters' command lines (kimi_hf.conversion.cli)
share. A leaf: it imports neither command line, so each can import it without importing the other.
"""

from __future__ import annotations

import argparse

from .conversion.safetensors_stream import parse_size


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (`PROG: error: ...`, exit status 2) that point to --help."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def shard_size(text: str) -> int:
    """argparse type of --max-shard-size (every converter's): '5GB', '500MB', '100KB' or a number of bytes, > 0."""
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


__all__ = ["ArgumentParser", "layer_count", "shard_size"]
