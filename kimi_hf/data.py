"""Offline training text: the Python standard library's own source files as a byte-level corpus.

Every machine with Python has it, nothing is downloaded, and it is real text (code, docstrings,
comments). Batches are a pure function of (seed, step, rank, world): runs are reproducible and a
distributed run sees exactly the rows of the single-process run, split across ranks.
"""

from __future__ import annotations

import os
import sysconfig

import torch


BYTE_VOCAB = 256
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258  # byte-level models use a vocabulary of 259


def stdlib_source_files() -> list[str]:
    """Paths of the standard library's .py files (sorted; no site-packages, no test suites)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "idle_test", "__pycache__")
        )
        files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def stdlib_bytes(max_bytes: int = 4_000_000) -> bytes:
    """Concatenated standard-library sources, up to max_bytes."""
    chunks, total = [], 0
    for path in stdlib_source_files():
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no Python sources found under {sysconfig.get_paths()['stdlib']}")
    return b"".join(chunks)[:max_bytes]


class ByteCorpus:
    """Byte-level train / validation split of a text, with deterministic random windows."""

    def __init__(self, data: bytes | None = None, val_fraction: float = 0.05, max_bytes: int = 4_000_000):
        data = stdlib_bytes(max_bytes) if data is None else data
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n_val = max(1, int(len(tokens) * val_fraction))
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]

    def batch(
        self,
        step: int,
        batch_size: int,
        seq_len: int,
        *,
        split: str = "train",
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> torch.Tensor:
        """[batch_size // world, seq_len] windows of the global batch number `step`; rank r takes
        rows r, r + world, ... (global batch_size must be divisible by world)."""
        if batch_size % world:
            raise ValueError(f"batch_size {batch_size} is not divisible by world size {world}")
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len:
            raise ValueError(f"seq_len {seq_len} exceeds the {split} split ({len(data)} tokens)")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=gen)[rank::world]
        return torch.stack([data[s : s + seq_len] for s in starts.tolist()])


__all__ = ["ByteCorpus", "stdlib_bytes", "stdlib_source_files", "BYTE_VOCAB", "PAD_ID", "BOS_ID", "EOS_ID"]
