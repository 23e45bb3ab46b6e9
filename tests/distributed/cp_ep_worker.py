"""Run by test_context.py under torchrun (gloo, CPU, 4 ranks): CP 2 x FSDP2 x EP 2 on a tiny Kimi K3 folder in the
released layout (transformers' DistributedConfig(fsdp_size=2, ep_size=2) shards it at load, experts whole over the
ep ranks, dense experts for full fine-tuning): two batches of one sequence, each split over a context-parallel pair of
data ranks; one forward and backward. Rank 0 writes the loss and every parameter's full gradient (FSDP2 / EP DTensors
gathered); `reference(folder)` is the same in one process, both sequences at once.

    python -m torch.distributed.run --nproc_per_node 4 cp_ep_worker.py FOLDER OUT.pt
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForImageTextToText
from transformers.distributed import DistributedConfig
from transformers.loss.loss_utils import ForCausalLMLoss

import kimi_hf  # noqa: F401  (registers the Kimi classes)
from kimi_hf.distributed.context import context_parallel_batch, context_parallel_group, enable_context_parallel
from tests.distributed.cp_worker import labels_of


SEQ = 32


def batch(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab - 2, (2, SEQ), generator=torch.Generator().manual_seed(5))


def load(folder: str, **kwargs):
    return AutoModelForImageTextToText.from_pretrained(folder, experts_format="dense", dtype=torch.float32, **kwargs)


def loss_of(logits, labels, vocab: int, n_items: float):
    return ForCausalLMLoss(logits, None, vocab, num_items_in_batch=n_items, shift_labels=labels)


def reference(folder: str) -> dict:
    model = load(folder).train()
    vocab = model.config.get_text_config().vocab_size
    ids = batch(vocab)
    labels = labels_of(ids, torch.arange(SEQ).expand_as(ids))
    loss = loss_of(model(input_ids=ids, use_cache=False).logits, labels, vocab, int((labels != -100).sum()))
    loss.backward()
    return {
        "loss": loss.item(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }


def main(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    dc = DistributedConfig(fsdp_size=2, ep_size=2, dp_replicate_size=2)
    model = load(folder, distributed_config=dc).train()
    manager = model._mesh_manager
    fsdp, rep = manager.get_mesh("fsdp"), manager.get_mesh("dp_replicate")
    data_rank = rep.get_local_rank() * fsdp.size() + fsdp.get_local_rank()  # 4 data ranks: 2 batches x CP 2
    group = context_parallel_group(data_rank, 2)
    enable_context_parallel(model, group)
    vocab = model.config.get_text_config().vocab_size
    ids = batch(vocab)[data_rank // 2 : data_rank // 2 + 1]
    n_items = 2 * (SEQ - 1)
    part = context_parallel_batch(ids, group)
    logits = model(input_ids=part["input_ids"], position_ids=part["position_ids"], use_cache=False).logits
    # FSDP2 averages the 4 data ranks' gradients: each rank's share of the step's mean loss, times 4
    loss = loss_of(logits, part["shift_labels"], vocab, n_items / 4)
    loss.backward()
    total = loss.detach() / 4
    dist.all_reduce(total)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            grads[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    if dist.get_rank() == 0:
        torch.save({"loss": total.item(), "grads": grads}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
