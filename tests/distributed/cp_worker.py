"""Run by test_context.py under torchrun (gloo, CPU): forward and backward of tiny Kimi K3 / Kimi Linear models with
each sequence split over the context-parallel ranks, then one MuonClip step; writes what each rank gets (its logits
slice, the loss, every parameter's gradient summed over the ranks, the weights after the step). `reference(case)`
is the same in one process, the whole sequences at once.

    python -m torch.distributed.run --nproc_per_node 2 cp_worker.py OUT_DIR
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.loss.loss_utils import ForCausalLMLoss

from kimi_hf.distributed.context import context_parallel_batch, enable_context_parallel
from kimi_hf.optim import MuonClip
from tests.optim import distributed_helpers as helpers


BATCH, SEQ = 2, 24


@dataclass(frozen=True)
class Case:
    name: str
    arch: str  # "k3" (Block AttnRes, safe gate, gated MLA), "hybrid" (Kimi Linear's layers, no AttnRes)
    documents: tuple = ()  # packed: the lengths of the documents of a row (2 ranks: 48 tokens), or of each row
    attn: str = "sdpa"


CASES = (
    Case("k3", "k3"),
    # the boundary (token 24) inside a document, then a one-token document and a short one
    Case("k3_packed", "k3", (29, 1, 14, 4), "eager"),
    Case("hybrid", "hybrid", attn="eager"),
    # the boundary on a document start; a document shorter than the short convolution's taps
    Case("hybrid_packed", "hybrid", (24, 2, 22)),
    # two packed rows: one cut inside a document, one on a start
    Case("k3_packed_rows", "k3", ((30, 18), (10, 14, 24)), "sdpa"),
)


def build(case: Case):
    torch.manual_seed(0)
    model = helpers.build(case.arch)  # the FSDP2 tests' tiny K3 (vision tower included) and Kimi Linear
    model.set_attn_implementation(case.attn)
    return model.train()


def inputs(case: Case, size: int):
    """(input_ids [B, T], position_ids [B, T]) of the whole sequences: BATCH rows, or one row of packed documents."""
    gen = torch.Generator().manual_seed(7)
    T = SEQ * size
    if not case.documents:
        return torch.randint(3, 97, (BATCH, T), generator=gen), torch.arange(T).expand(BATCH, T)
    rows = case.documents if isinstance(case.documents[0], tuple) else (case.documents,)
    assert all(sum(r) == T for r in rows)
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    return torch.randint(3, 97, (len(rows), T), generator=gen), pos


def labels_of(ids, pos):
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[:, :-1][pos[:, 1:] != pos[:, :-1] + 1] = -100
    return labels


def run(case: Case, group=None, cp: bool = False) -> dict:
    """Forward, backward and one MuonClip step; with cp, this rank's part of every sequence."""
    size = dist.get_world_size(group) if cp else 2
    model = build(case)
    ids, pos = inputs(case, size)
    labels = labels_of(ids, pos)
    n_items = int((labels != -100).sum())
    vocab = model.config.get_text_config().vocab_size
    if cp:
        enable_context_parallel(model, group)
        part = context_parallel_batch(ids, group, pos)
        ids, pos, labels = part["input_ids"], part["position_ids"], part["shift_labels"]
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    loss = ForCausalLMLoss(logits, None, vocab, num_items_in_batch=n_items, shift_labels=labels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    total = loss.detach().clone()
    if cp:  # the ranks' partial sums over their tokens
        dist.all_reduce(total, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
        for n, p in model.named_parameters():
            if p.grad is not None:
                p.grad.copy_(grads[n])
    opt = MuonClip.from_model(model, lr=1e-2, qk_clip_tau=helpers.qk_clip_tau(case.arch))
    opt.step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": total, "grads": grads, "weights": weights}


def reference(case: Case, size: int = 2) -> dict:
    out = run(case)
    T = out["logits"].shape[1] // size
    out["logits"] = [out["logits"][:, r * T : (r + 1) * T] for r in range(size)]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for case in CASES:
        result = run(case, None, cp=True)
        torch.save(result, os.path.join(args.out, f"{case.name}.rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
