"""The global batch of each training step, the same in every layout (a pure function of the seed and the step):
{"input_ids", "labels", "position_ids"?} [rows, T], rows = micro_batches x micro_batch. `train_step` splits it over
the data ranks.

- `RandomTokens`: seeded token ids below the vocabulary (a folder without a tokenizer; smoke runs);
- `StdlibTokens`: the Python standard library's sources (kimi_hf.data) tokenized with the folder's tokenizer, cut
  into rows (offline real text);
- `PackedDataset` (kimi_hf.finetune.packing): the user's data in TRL's formats, tokenized by the chat template and
  packed with document boundaries.
"""

from __future__ import annotations

import torch


class RandomTokens:
    """Seeded token ids [rows, T] below `vocab_size`; `skip_id` (the image placeholder) replaced: a text batch."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, skip_id: int | None = None):
        self.vocab, self.seq_len, self.seed, self.skip_id = vocab_size, seq_len, seed, skip_id

    def global_batch(self, step: int, rows: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + step)
        ids = torch.randint(0, self.vocab, (rows, self.seq_len), generator=gen)
        if self.skip_id is not None:
            ids[ids == self.skip_id] = (self.skip_id + 1) % self.vocab
        return {"input_ids": ids, "labels": ids}


class StdlibTokens:
    """The standard library's sources tokenized with `tokenizer`, as consecutive rows of T tokens: enough for
    `steps` steps of `rows` rows (ValueError naming --steps when the corpus is shorter)."""

    CHUNK = 200_000  # bytes tokenized at a time

    def __init__(self, tokenizer, seq_len: int, steps: int, rows: int):
        from ..data import stdlib_bytes

        need = steps * rows * (seq_len + 1)
        ids, offset, corpus = [], 0, stdlib_bytes()
        while len(ids) < need and offset < len(corpus):
            ids += tokenizer(corpus[offset : offset + self.CHUNK].decode("utf-8", "ignore"))["input_ids"]
            offset += self.CHUNK
        if len(ids) < need:
            raise ValueError(f"--data stdlib: {len(ids)} tokens, {need} needed for --steps {steps}")
        self.tokens, self.seq_len = torch.tensor(ids[:need], dtype=torch.long), seq_len

    def global_batch(self, step: int, rows: int) -> dict[str, torch.Tensor]:
        T = self.seq_len
        start = step * rows * (T + 1)
        ids = self.tokens[start : start + rows * (T + 1)].view(rows, T + 1)[:, :T]
        return {"input_ids": ids, "labels": ids}


__all__ = ["RandomTokens", "StdlibTokens"]
