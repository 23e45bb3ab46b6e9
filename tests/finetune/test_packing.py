"""Packing (kimi_hf.finetune.packing): every document once per epoch, its boundaries in the position ids and the
labels, batches a pure function of the step whatever the data ranks' layout, and a tiny Kimi K3 running a packed row
exactly as it runs its documents one by one."""

import pytest
import torch
import torch.nn.functional as F

from kimi_hf.collators import IGNORE_INDEX
from kimi_hf.finetune.data import Documents, load_sft_rows, tokenize_sft_rows
from kimi_hf.finetune.packing import PackedDataset, best_fit_decreasing


PAD = 0


def make_docs(lengths, trained=None) -> Documents:
    """Documents whose tokens name themselves: token t of document d is (d + 1) * 1000 + t. trained: per document,
    a bool [n] of the tokens with a label (default: all); the first token never has one."""
    ids, labels = [], []
    for d, n in enumerate(lengths):
        x = (d + 1) * 1000 + torch.arange(n)
        keep = torch.ones(n, dtype=torch.bool) if trained is None else trained[d]
        y = torch.where(keep, x, IGNORE_INDEX)
        y[0] = IGNORE_INDEX
        ids.append(x)
        labels.append(y)
    offsets = torch.tensor([0] + list(lengths)).cumsum(0)
    return Documents(torch.cat(ids), torch.cat(labels), offsets, torch.arange(len(lengths)))


def pieces_of(packed: PackedDataset, docs: Documents, index: int) -> list[tuple[int, int, int]]:
    """(document, first token, count) of each document piece in global row `index`, checking the row's conventions:
    positions restart at 0 at every piece, labels are the document's but IGNORE_INDEX at a piece's first token,
    padding (only at the row end) is one piece of PAD tokens with positions 0, 1, ... and no labels."""
    ids, labels, pos = packed.row(index)
    T = packed.seq_len
    assert ids.shape == labels.shape == pos.shape == (T,) and ids.dtype == labels.dtype == pos.dtype == torch.int64
    starts = torch.nonzero(pos == 0).flatten().tolist() + [T]
    out = []
    for a, b in zip(starts[:-1], starts[1:]):
        assert torch.equal(pos[a:b], torch.arange(b - a))
        if ids[a] == PAD:
            assert b == T and (ids[a:b] == PAD).all() and (labels[a:b] == IGNORE_INDEX).all()
            continue
        d, t = divmod(ids[a].item(), 1000)
        d -= 1
        o = docs.offsets[d].item() + t
        assert torch.equal(ids[a:b], docs.input_ids[o : o + b - a])
        assert labels[a] == IGNORE_INDEX and torch.equal(labels[a + 1 : b], docs.labels[o + 1 : o + b - a])
        out.append((d, t, b - a))
    return out


def test_best_fit_decreasing():
    # 5 opens bin 0 (room 3), 4 bin 1 (room 4), 3 fills bin 0, 3 -> bin 1 (room 1), 2 opens bin 2, 1 fills bin 1
    assert best_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    lengths = torch.randint(1, 33, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    bins = best_fit_decreasing(lengths, 32)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 32 for b in bins)
    assert len(bins) <= sum(lengths) / 32 * 1.05 + 1  # nearly full rows


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_every_document_once_an_epoch_with_its_boundaries(strategy):
    lengths = torch.randint(1, 50, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    docs, T = make_docs(lengths), 32
    packed = PackedDataset(docs, T, strategy=strategy, seed=7, pad_id=PAD)
    R = packed.rows_per_epoch
    orders = []
    for epoch in (0, 1):
        pieces = [p for r in range(R) for p in pieces_of(packed, docs, epoch * R + r)]
        orders.append([d for d, _, _ in pieces])
        covered = {}
        for d, t, n in pieces:
            covered.setdefault(d, []).append((t, n))
        if strategy == "bfd":  # whole documents, the long ones cut to their first T tokens
            assert covered == {d: [(0, min(n, T))] for d, n in enumerate(lengths)}
            assert packed.truncated == sum(n > T for n in lengths) and packed.dropped == 0
        else:  # every token once, only the last row padded
            for d, n in enumerate(lengths):  # the pieces tile the document (in rows shuffled like any others)
                ends = [t + k for t, k in sorted(covered[d])]
                assert [t for t, _ in sorted(covered[d])] == [0] + ends[:-1] and ends[-1] == n
            assert R == -(-sum(lengths) // T)
            assert sum(int((packed.row(epoch * R + r)[0] == PAD).sum()) for r in range(R)) == R * T - sum(lengths)
    assert orders[0] != orders[1] and set(orders[0]) == set(orders[1]) == set(range(60))  # reshuffled


def test_overflow_truncates_or_drops():
    """A document longer than T: cut to its first T tokens, or dropped; one left with nothing to train on (its
    labels all past T) is dropped either way."""
    late = torch.arange(50) >= 40  # labels only on tokens 40..49
    docs = make_docs([10, 50, 40], trained=[torch.ones(10, dtype=torch.bool), late, torch.ones(40, dtype=torch.bool)])
    cut = PackedDataset(docs, 32, pad_id=PAD)
    assert (cut.truncated, cut.dropped, cut.tokens) == (1, 1, 10 + 32)
    kept = {d for r in range(cut.rows_per_epoch) for d, _, _ in pieces_of(cut, docs, r)}
    assert kept == {0, 2}
    drop = PackedDataset(docs, 32, pad_id=PAD, overflow="drop")
    assert (drop.truncated, drop.dropped, drop.tokens) == (0, 2, 10)
    with pytest.raises(ValueError, match="no document fits"):
        PackedDataset(make_docs([40]), 32, pad_id=PAD, overflow="drop")


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
def test_batches_are_a_pure_function_of_the_step(strategy):
    docs = make_docs(torch.randint(1, 40, (50,), generator=torch.Generator().manual_seed(2)).tolist())
    a = PackedDataset(docs, 32, strategy=strategy, seed=3, pad_id=PAD)
    b = PackedDataset(docs, 32, strategy=strategy, seed=3, pad_id=PAD)
    R, rows = a.rows_per_epoch, 4
    step = R // rows  # straddles epochs 0 and 1 unless R divides by 4
    for s in (step, 0, step + 3):  # any order: a resumed run builds batch s from nothing
        batch = a.global_batch(s, rows)
        assert all(torch.equal(batch[k], b.global_batch(s, rows)[k]) for k in batch)
        assert sorted(batch) == ["input_ids", "labels", "position_ids"]
        assert all(v.shape == (rows, 32) and v.dtype == torch.int64 for v in batch.values())
    other = PackedDataset(docs, 32, strategy=strategy, seed=4, pad_id=PAD)
    assert not torch.equal(other.global_batch(0, rows)["input_ids"], a.global_batch(0, rows)["input_ids"])
    assert a.epoch(step, rows) == step * rows / R

    evaluation = PackedDataset(docs, 32, strategy=strategy, pad_id=PAD, shuffle=False)
    batches = list(evaluation.epoch_batches(rows))
    assert len(batches) == -(-evaluation.rows_per_epoch // rows)
    rows_seen = torch.cat([x["input_ids"] for x in batches])
    assert torch.equal(
        rows_seen[: evaluation.rows_per_epoch], evaluation.global_batch(0, evaluation.rows_per_epoch)["input_ids"]
    )
    assert (rows_seen[evaluation.rows_per_epoch :] == PAD).all()
    assert (torch.cat([x["labels"] for x in batches])[evaluation.rows_per_epoch :] == IGNORE_INDEX).all()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_a_tiny_k3_runs_a_packed_row_as_its_documents_alone():
    """Two K3 chats packed in one row (bfd, padding after them), fp32: each document's logits and per-token losses
    are those of the document run alone (relative error < 1e-5: only the summation order differs), and the
    model's loss over the row is the token-weighted mean of the documents' losses. So the boundaries reach the
    model: KDA's state and short convolutions restart, MLA attends within a document, and no label predicts
    across a boundary. Control: the same tokens as one document differ."""
    from kimi_hf import KimiK3ForCausalLM
    from kimi_hf.models.kimi_k3.xtml_kimi_k3 import K3_STOP_TOKEN
    from kimi_hf.presets import small_k3_config
    from kimi_hf.tokenization import train_tokenizer

    tok = train_tokenizer(["hello world, the weather in Paris is 18C.", "What is 15% of 240? It is 36."], 300, "k3")
    chats = [
        [{"role": "user", "content": "What is 15% of 240?"}, {"role": "assistant", "content": "It is 36."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Paris", "reasoning_content": "the weather"},
        ],
    ]
    docs = tokenize_sft_rows(
        load_sft_rows([{"messages": c} for c in chats]), tok, chat_template_kwargs={"thinking_effort": None}
    )
    T = int(docs.lengths.sum()) + 5
    packed = PackedDataset(docs, T, pad_id=tok.pad_token_id, shuffle=False)
    assert packed.rows_per_epoch == 1 and docs.lengths.min() > 40 and docs.lengths.max() > 64  # crosses a KDA chunk
    batch = packed.global_batch(0, 1)
    config = small_k3_config(
        hidden=64,
        layers=4,
        vocab_size=len(tok),
        experts=4,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.convert_tokens_to_ids(K3_STOP_TOKEN),
        pad_token_id=tok.pad_token_id,
    ).text_config
    torch.manual_seed(0)
    model = KimiK3ForCausalLM(config).eval()
    assert model.dtype == torch.float32
    with torch.no_grad():
        out = model(**batch, use_cache=False)
        layout = packed.layout(0)
        total, count, a = 0.0, 0, 0
        for d in layout.doc.tolist():
            o, n = docs.offsets[d].item(), docs.lengths[d].item()
            ids, labels = docs.input_ids[o : o + n][None], docs.labels[o : o + n][None]
            alone = model(input_ids=ids, labels=labels, use_cache=False)
            assert rel_err(out.logits[0, a : a + n], alone.logits[0]) < 1e-5
            per_token = F.cross_entropy(
                out.logits[0, a : a + n - 1], batch["labels"][0, a + 1 : a + n], reduction="none"
            )
            ref = F.cross_entropy(alone.logits[0, :-1], labels[0, 1:], reduction="none")
            assert rel_err(per_token, ref) < 1e-5
            k = int((labels != IGNORE_INDEX).sum())
            total, count, a = total + alone.loss.item() * k, count + k, a + n
        assert abs(out.loss.item() - total / count) < 1e-5 * total / count
        merged = model(input_ids=batch["input_ids"], use_cache=False).logits  # no boundaries: one long document
        n0 = docs.lengths[layout.doc[0]].item()
        assert rel_err(merged[0, n0:a], out.logits[0, n0:a]) > 1e-2
