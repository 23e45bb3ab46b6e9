"""One training step's forward and backward on a rank of any layout (`parallelize`'s ParallelModel), with the loss
divided so that the ranks' gradients add up to one process's gradient of the step's mean loss.

    batch = {"input_ids": ids, "labels": labels, "position_ids": pos}      # the step's GLOBAL batch [rows, T]
    part = train_step(rank, batch)      # this rank's share of the mean loss (all_reduce: the step's loss)
    optimizer.step()

The divisors: the loss is summed over tokens and divided by the label tokens of the whole step (every micro-batch,
every data rank: `num_items`, as transformers' Trainer does with `num_items_in_batch`), then multiplied by the data
ranks, because FSDP2 / transformers average the gradients over them (`CausalLMLoss`'s `grad_divide`). The pipeline
schedule must not scale again (`scale_grads=False`). The returned share is what this rank adds to the step's loss:
its data rank's part / data ranks / tp (a tp group computes the same loss), and nothing on the stages before the last.
"""

from __future__ import annotations

import torch

from ..collators import IGNORE_INDEX
from .parallelize import ParallelModel


def label_tokens(labels: torch.Tensor) -> int:
    """The tokens a batch's loss is over: labels [rows, T], unshifted (position t is predicted at t - 1), -100 not
    counted: (labels[:, 1:] != -100).sum()."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def local_rows(rank: ParallelModel, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global [rows, ...] tensor: the batch's share of its data rank's context-parallel group
    (data_rank // cp), in order."""
    dims = rank.dims
    rows = tensor.shape[0] // dims.batch_ranks
    batch = rank.data_rank // dims.cp
    return tensor[batch * rows : (batch + 1) * rows]


def _local_batch(rank: ParallelModel, batch: dict[str, torch.Tensor]):
    """(input_ids, labels, position_ids or None) of this rank's rows, and the label tokens of the whole batch."""
    if "input_ids" not in batch:
        raise ValueError("batch: needs input_ids [rows, T]")
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    positions = batch.get("position_ids")
    if ids.shape[0] != rank.micro_batches * rank.micro_batch:
        raise ValueError(
            f"batch: {ids.shape[0]} rows, but the step is --micro-batches {rank.micro_batches} x --micro-batch "
            f"{rank.micro_batch}"
        )
    local = local_rows(rank, ids), local_rows(rank, labels)
    return (*local, local_rows(rank, positions) if positions is not None else None), label_tokens(labels)


def train_step(rank: ParallelModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward and backward of this rank's share of the step's global batch: input_ids [rows, T], labels [rows, T]
    (default: input_ids; -100 not trained), position_ids [rows, T] (optional: packed documents restart at 0).
    rows = micro_batches x micro_batch. Returns this rank's share of the step's mean loss (a 0-dim tensor; the sum
    over the world is the step's loss)."""
    from .lora import average_unsharded_grads
    from .pipeline import CausalLMLoss

    dims = rank.dims
    (local_ids, local_labels, local_positions), num_items = _local_batch(rank, batch)
    if rank.schedule is not None:
        rank.loss_fn.num_items = num_items
        losses = _pipeline(rank, rank.schedule.step, local_ids, local_labels, local_positions)
        if not rank.stage.is_last:
            return torch.zeros((), device=rank.device)
        return torch.stack([loss.detach() for loss in losses]).sum() / (dims.data_ranks * dims.tp)
    loss_fn = CausalLMLoss(rank.config.get_text_config().vocab_size, num_items, grad_divide=dims.data_ranks)
    total = torch.zeros((), device=rank.device)
    for loss in _micro_batch_losses(rank, local_ids, local_labels, local_positions, loss_fn):
        loss.backward()
        total += loss.detach() / dims.data_ranks
    if rank.sync_adapters:
        average_unsharded_grads(rank.model, rank.groups.get("adapters"))
    return total / dims.tp  # the tp ranks of a data rank computed the same loss


def _pipeline(rank: ParallelModel, run, ids, labels, positions) -> list[torch.Tensor]:
    """One pass of the pipeline schedule (`run`: its `step`, or `eval` for the forward alone) over this data rank's
    rows, each sequence split over the context-parallel group; the last stage's micro-batch losses ([] elsewhere)."""
    from .context import context_parallel_batch

    context = rank.groups.get("context")
    inputs, target = ids, labels
    if context is not None:  # this rank's slice of each sequence, the labels shifted before the cut
        part = context_parallel_batch(ids, context, position_ids=positions, labels=labels)
        inputs, target = part["input_ids"], part["shift_labels"]
        positions = part["position_ids"] if positions is not None else None
    # packed documents: every stage builds its masks from the position ids (a keyword each rank passes, split into
    # micro-batches as the inputs are)
    extra = {"position_ids": positions.to(rank.device)} if positions is not None else {}
    losses = []
    if rank.stage.is_first:
        run(inputs.to(rank.device), **extra)
    elif rank.stage.is_last:
        run(target=target.to(rank.device), losses=losses, **extra)
    else:
        run(**extra)
    return losses


def _micro_batch_losses(rank: ParallelModel, ids, labels, positions, loss_fn):
    """The loss of each of this rank's micro-batches (pp == 1), its sequences split over the context-parallel group."""
    from .context import context_parallel_batch

    context = rank.groups.get("context")
    for i in range(0, ids.shape[0], rank.micro_batch):
        mb = slice(i, i + rank.micro_batch)
        inputs = {"input_ids": ids[mb].to(rank.device)}
        mb_labels, shifted = labels[mb].to(rank.device), None
        if positions is not None:
            inputs["position_ids"] = positions[mb].to(rank.device)
        if context is not None:  # this rank's slice of each sequence, its labels shifted before the cut
            part = context_parallel_batch(
                inputs["input_ids"], context, position_ids=inputs.get("position_ids"), labels=mb_labels
            )
            inputs = {k: part[k] for k in ("input_ids", "position_ids")}
            mb_labels, shifted = None, part["shift_labels"]
        if rank.config.get_text_config().loss_chunk_size is not None:  # the model's chunked head + loss
            kwargs = {"labels": mb_labels if shifted is None else shifted, "shift_labels": shifted}
            yield rank.module(**inputs, **kwargs, num_items_in_batch=loss_fn.num_items_in_batch, use_cache=False).loss
        else:
            logits = rank.module(**inputs, use_cache=False).logits
            yield loss_fn(logits, mb_labels, shifted)


@torch.no_grad()
def eval_step(rank: ParallelModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed loss and the label tokens of a global batch (as train_step's), without a backward: a [2] fp32
    tensor (loss sum, tokens) of this rank's share; all_reduce over the world, then sum / tokens is the batch's mean
    loss (the tp ranks' copies scale both alike). Under pp the schedule runs forward only and the last stage's ranks
    hold the shares (the others: zeros)."""
    from .pipeline import CausalLMLoss

    (ids, labels, positions), _ = _local_batch(rank, batch)
    was_training = rank.model.training
    rank.model.eval()
    try:
        if rank.schedule is not None:
            loss_fn = rank.loss_fn
            scale = loss_fn.num_items, loss_fn.grad_divide
            loss_fn.num_items, loss_fn.grad_divide = 1, 1  # summed over the tokens
            try:
                losses = _pipeline(rank, rank.schedule.eval, ids, labels, positions)
            finally:
                loss_fn.num_items, loss_fn.grad_divide = scale
        else:
            loss_fn = CausalLMLoss(rank.config.get_text_config().vocab_size, 1)  # summed over the tokens
            losses = _micro_batch_losses(rank, ids, labels, positions, loss_fn)
        total = sum((loss.detach().float() for loss in losses), torch.zeros((), device=rank.device))
    finally:
        rank.model.train(was_training)
    # this rank's tokens: under cp its slice's shifted labels; the cp ranks' slices add up to the rows'
    tokens = label_tokens(labels) / rank.dims.cp if rank.stage is None or rank.stage.is_last else 0
    return torch.stack([total, torch.tensor(float(tokens), device=rank.device)])


__all__ = ["eval_step", "label_tokens", "local_rows", "train_step"]
