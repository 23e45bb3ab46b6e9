"""Tokenized documents packed into fixed-length rows [rows, T], with the document boundaries carried to the model.

    packed = PackedDataset(docs, seq_len=T, strategy="bfd", seed=0, pad_id=tokenizer.pad_token_id)
    batch = packed.global_batch(step, rows)   # {"input_ids", "labels", "position_ids"}: [rows, T] int64 each
    loss = model(**batch).loss                # no attention_mask: the position ids carry the documents

The model's convention (KimiHybridTextModel.positions -> PackedSequences.from_position_ids, transformers'
find_packed_sequence_indices): with no attention mask, a new document starts wherever position_ids do not go up by
exactly 1; KDA then runs each document as its own sequence (state and short convolutions restart) and MLA attends
within it. So in every row:

- position_ids count 0, 1, 2, ... inside each document (and inside each piece of a document cut by a row end);
- padding (pad_id, at the row end) is a document of its own: position_ids 0, 1, 2, ... over the pad run, labels
  IGNORE_INDEX (the pads come after every real token, so causally they change nothing before them anyway);
- labels are the documents' labels (Documents: unshifted, transformers shifts them in the loss: labels[t] is
  predicted from token t - 1) with IGNORE_INDEX wherever position_ids == 0: a document's first token, a cut
  continuation's first token and the first pad are never predicted from the token before them (another document).
  Every row starts at position 0, so labels[:, 0] is always IGNORE_INDEX and (labels != IGNORE_INDEX).sum() is
  exactly the number of tokens the loss averages over (transformers' num_items_in_batch).

Strategies (TRL's names):
- "bfd" (best-fit decreasing): whole documents, longest first, each into the row with the least room that holds it,
  else a new row; rows padded at the end. A document longer than T is cut to its first T tokens
  (overflow="truncate", TRL's default) or left out (overflow="drop"); either way, one left without a trained token is
  left out. `truncated` and `dropped` count them.
- "wrapped": documents concatenated and cut every T tokens (no padding but the last row's); the piece after a cut
  starts a row and restarts its position ids (it no longer sees the document's beginning). Nothing is cut off.

Determinism: epoch e's rows are a pure function of (documents, seq_len, strategy, seed, e): the documents are
shuffled by a generator seeded with (seed, e) before packing (bfd: the order among documents of equal length) and
the rows are shuffled after; the number of rows per epoch is the same for every epoch. Global row g is row g % R of
epoch g // R (R rows an epoch), and global_batch(step, rows) is rows [step * rows, (step + 1) * rows): a pure
function of step, so a run resumes at a step with nothing saved, and is the same whatever the data ranks' layout
(kimi_hf.distributed.train_step splits it over them).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass

import numpy as np
import torch

from ..collators import IGNORE_INDEX
from .data import Documents


STRATEGIES = ("bfd", "wrapped")
OVERFLOWS = ("truncate", "drop")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: items by decreasing length (ties in the given order), each into the bin with the least
    room that holds it, else a new bin. Every length must be in 1 .. capacity. O(n log n) plus the sorted list of
    distinct free rooms (at most `capacity` entries)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep the given order
    rooms: list[int] = []  # the distinct free rooms of open bins, sorted
    bins_with_room: dict[int, deque[int]] = defaultdict(deque)  # room -> bins with exactly that room (oldest first)
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            b = bins_with_room[room].popleft()
            if not bins_with_room[room]:
                rooms.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        left = room - n
        if left > 0:
            if not bins_with_room[left]:
                bisect.insort(rooms, left)
            bins_with_room[left].append(b)
    return bins


@dataclass(frozen=True)
class RowLayout:
    """One epoch's rows as pieces of documents: row r is pieces row_ptr[r] .. row_ptr[r + 1] - 1, piece p being
    tokens start[p] .. start[p] + length[p] - 1 of document doc[p] (numpy int64 arrays)."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    row_ptr: np.ndarray

    def __len__(self) -> int:
        return len(self.row_ptr) - 1


def _layout(pieces: list[tuple[int, int, int]], row_ends: list[int]) -> RowLayout:
    arr = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
    return RowLayout(arr[:, 0], arr[:, 1], arr[:, 2], np.asarray([0] + row_ends, dtype=np.int64))


class PackedDataset:
    """Documents packed into rows of seq_len tokens (see the module: strategies, conventions, determinism).

    rows_per_epoch: R; truncated / dropped: documents cut to seq_len / left out (bfd); tokens: the real tokens an
    epoch holds. shuffle=False (evaluation): the documents in order, the rows in packing order."""

    def __init__(
        self,
        docs: Documents,
        seq_len: int,
        *,
        strategy: str = "bfd",
        seed: int = 0,
        pad_id: int = 0,
        overflow: str = "truncate",
        shuffle: bool = True,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {OVERFLOWS}, got {overflow!r}")
        if not (isinstance(seq_len, int) and seq_len >= 2):
            raise ValueError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        if pad_id is None:
            raise ValueError("pad_id is None: the tokenizer needs a pad token")
        self.docs, self.seq_len, self.strategy, self.seed = docs, seq_len, strategy, seed
        self.pad_id, self.shuffle = int(pad_id), shuffle
        self.offsets = docs.offsets.numpy()
        lengths = docs.lengths.numpy()
        self.truncated = self.dropped = 0
        if strategy == "bfd":
            kept = np.minimum(lengths, seq_len) if overflow == "truncate" else np.where(lengths > seq_len, 0, lengths)
            trained = docs.labels != IGNORE_INDEX
            cum = torch.cat([torch.zeros(1, dtype=torch.int64), trained.cumsum(0)]).numpy()
            has_label = cum[self.offsets[:-1] + kept] - cum[self.offsets[:-1]] > 0
            self.truncated = int(((lengths > seq_len) & has_label).sum()) if overflow == "truncate" else 0
            keep = has_label & (kept > 0)
            self.dropped = int((~keep).sum())
            self.kept_docs = np.flatnonzero(keep)
            self.kept_lengths = kept[keep]
        else:
            self.kept_docs, self.kept_lengths = np.arange(len(lengths)), lengths
        if len(self.kept_docs) == 0:
            raise ValueError(f"no document fits in seq_len {seq_len} with a token to train on")
        self.tokens = int(self.kept_lengths.sum())
        self._cache: OrderedDict[int, RowLayout] = OrderedDict()
        self.rows_per_epoch = len(self.layout(0))

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)

    def layout(self, epoch: int) -> RowLayout:
        """Epoch `epoch`'s rows (the two most recent epochs are kept: a batch may straddle two)."""
        if epoch in self._cache:
            self._cache.move_to_end(epoch)
            return self._cache[epoch]
        n = len(self.kept_docs)
        gen = self._generator(epoch) if self.shuffle else None
        order = torch.randperm(n, generator=gen).numpy() if gen is not None else np.arange(n)
        docs, lengths = self.kept_docs[order], self.kept_lengths[order]
        layout = self._bfd(docs, lengths) if self.strategy == "bfd" else self._wrapped(docs, lengths)
        if gen is not None:  # the rows' order
            rows = torch.randperm(len(layout), generator=gen).numpy()
            layout = _reorder(layout, rows)
        if epoch and len(layout) != self.rows_per_epoch:
            raise RuntimeError(f"epoch {epoch} packed {len(layout)} rows, epoch 0 {self.rows_per_epoch}")
        self._cache[epoch] = layout
        while len(self._cache) > 2:
            self._cache.popitem(last=False)
        return layout

    def _bfd(self, docs: np.ndarray, lengths: np.ndarray) -> RowLayout:
        pieces, ends = [], []
        for items in best_fit_decreasing(lengths.tolist(), self.seq_len):
            pieces += [(docs[i], 0, lengths[i]) for i in items]
            ends.append(len(pieces))
        return _layout(pieces, ends)

    def _wrapped(self, docs: np.ndarray, lengths: np.ndarray) -> RowLayout:
        pieces, ends, room = [], [], self.seq_len
        for d, n in zip(docs.tolist(), lengths.tolist()):
            start = 0
            while start < n:
                take = min(room, n - start)
                pieces.append((d, start, take))
                start, room = start + take, room - take
                if room == 0:
                    ends.append(len(pieces))
                    room = self.seq_len
        if room < self.seq_len:
            ends.append(len(pieces))
        return _layout(pieces, ends)

    def row(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global row `index` (row index % R of epoch index // R): (input_ids, labels, position_ids), [T] int64."""
        layout = self.layout(index // self.rows_per_epoch)
        r = index % self.rows_per_epoch
        T, ids, labels, positions = self.seq_len, [], [], []
        for p in range(layout.row_ptr[r], layout.row_ptr[r + 1]):
            a = int(self.offsets[layout.doc[p]] + layout.start[p])
            n = int(layout.length[p])
            ids.append(self.docs.input_ids[a : a + n])
            labels.append(self.docs.labels[a : a + n])
            positions.append(torch.arange(n))
        pad = T - sum(len(x) for x in ids)
        ids.append(torch.full((pad,), self.pad_id, dtype=torch.int64))
        labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.int64))
        positions.append(torch.arange(pad))
        ids, labels, positions = torch.cat(ids), torch.cat(labels), torch.cat(positions)
        labels = labels.masked_fill(positions == 0, IGNORE_INDEX)  # nothing before a document's start predicts it
        return ids, labels, positions

    def _batch(self, indices) -> dict[str, torch.Tensor]:
        rows = [self.row(i) for i in indices]
        return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(("input_ids", "labels", "position_ids"))}

    def global_batch(self, step: int, rows: int) -> dict[str, torch.Tensor]:
        """Batch `step` of `rows` rows: global rows step * rows .. (step + 1) * rows - 1, across epochs.
        {"input_ids", "labels", "position_ids"}: [rows, T] int64. Pass them to the model as they are (no
        attention_mask)."""
        return self._batch(range(step * rows, (step + 1) * rows))

    def epoch(self, step: int, rows: int) -> float:
        """The epochs done before batch `step` (a fraction)."""
        return step * rows / self.rows_per_epoch

    def epoch_batches(self, rows: int):
        """Epoch 0 in batches of `rows` rows (for evaluation, with shuffle=False), the last one filled up with rows
        of padding (labels all IGNORE_INDEX), so that every batch has the same shape: yields global_batch-like
        dicts, math.ceil(R / rows) of them."""
        R = self.rows_per_epoch
        for b in range(math.ceil(R / rows)):
            batch = self._batch(range(b * rows, min((b + 1) * rows, R)))
            missing = (b + 1) * rows - R
            if missing > 0:
                T = self.seq_len
                fill = {
                    "input_ids": torch.full((missing, T), self.pad_id, dtype=torch.int64),
                    "labels": torch.full((missing, T), IGNORE_INDEX, dtype=torch.int64),
                    "position_ids": torch.arange(T).expand(missing, T),
                }
                batch = {k: torch.cat([v, fill[k]]) for k, v in batch.items()}
            yield batch


def _reorder(layout: RowLayout, rows: np.ndarray) -> RowLayout:
    """`layout` with its rows in the order `rows`."""
    counts = np.diff(layout.row_ptr)[rows]
    take = np.concatenate([np.arange(layout.row_ptr[r], layout.row_ptr[r + 1]) for r in rows])
    ptr = np.concatenate([[0], np.cumsum(counts)])
    return RowLayout(layout.doc[take], layout.start[take], layout.length[take], ptr)


__all__ = ["PackedDataset", "RowLayout", "STRATEGIES", "OVERFLOWS", "best_fit_decreasing"]
