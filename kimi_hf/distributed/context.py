"""Context parallelism for Kimi Linear and Kimi K3: each rank of a group holds consecutive tokens of the same
sequences; the layers exchange what crosses the cut (the model side: models/kimi_hybrid/context_kimi_hybrid.py,
KDA's composed state maps: ops/kda_context.py).

    enable_context_parallel(model, cp_group)                 # the decoder splits every forward's sequences
    batch = context_parallel_batch(input_ids, cp_group)      # this rank's input_ids, position_ids, shift_labels
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss = ForCausalLMLoss(logits, None, vocab, num_items_in_batch=n, shift_labels=batch["shift_labels"])

The ranks' parameter gradients are partial sums over their tokens: reduce them over the group as data parallelism
does (FSDP2 over a mesh that includes the context-parallel ranks, with the loss scaled as `CausalLMLoss` does).
See docs/parallelism.md ("Context parallelism").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models.kimi_hybrid.context_kimi_hybrid import ContextParallelism, check_attention
from ..models.kimi_hybrid.pipeline_kimi_hybrid import decoder_of


def enable_context_parallel(model: nn.Module, group) -> nn.Module:
    """Makes `model`'s decoder (a kimi_hf Kimi Linear / K3 model, PEFT-wrapped or not) run each forward's tokens as
    this rank's slice of sequences split over `group` (None: the world); returns the model. Raises ValueError for
    an attention implementation context parallelism cannot run."""
    decoder = decoder_of(model) if hasattr(_base(model), "model") else None
    if not hasattr(decoder, "_context_parallel"):
        raise TypeError(f"{type(model).__name__} is not a kimi_hf hybrid model: it has no context parallelism")
    check_attention(decoder.config, "enable_context_parallel")
    decoder._context_parallel = ContextParallelism(group)
    return model


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def disable_context_parallel(model: nn.Module) -> nn.Module:
    """Back to whole sequences on every rank (e.g. to evaluate or generate after training); returns the model."""
    decoder_of(model)._context_parallel = None
    return model


def context_parallel_group(data_rank: int, cp: int, tp_rank: int = 0, pp_rank: int = 0):
    """This rank's context-parallel group (collective: every rank calls it). The parallelism engines (FSDP2,
    transformers' tensor / expert parallelism) see data ranks 0 .. n-1; context parallelism splits each batch over
    `cp` consecutive ones: data ranks d with the same d // cp (and the same tensor-parallel rank: they must hold the
    same heads; the same pipeline stage: they must hold the same layers) form a group, in the order of d % cp (the
    order of the sequence's slices)."""
    world = dist.get_world_size()
    mine = torch.tensor([data_rank // cp, tp_rank, pp_rank, data_rank % cp, dist.get_rank()])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    members: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for batch, tp, pp, part, rank in (t.tolist() for t in everyone):
        members.setdefault((batch, tp, pp), []).append((part, rank))
    group = None
    for key in sorted(members):  # every rank creates every group, in one order (new_group is collective)
        parts = sorted(members[key])
        if [p for p, _ in parts] != list(range(cp)):
            raise ValueError(f"context parallelism: the data ranks do not form groups of --cp {cp} ({parts})")
        created = dist.new_group([r for _, r in parts])
        if key == (data_rank // cp, tp_rank, pp_rank):
            group = created
    return group


def shard_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's slice of x along `dim` (rank r: the r-th of size equal parts). ValueError if they are not equal."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % size:
        raise ValueError(
            f"context parallelism: the sequence length {x.shape[dim]} is not divisible by the {size} context-parallel "
            "ranks"
        )
    return x.chunk(size, dim)[rank].contiguous()


def context_parallel_batch(
    input_ids: torch.Tensor, group, position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None
) -> dict:
    """This rank's part of a batch of whole sequences: input_ids [B, T] (and position_ids [1 or B, T], restarting at
    0 for packed documents; default 0 .. T - 1; labels [B, T], unshifted, -100 not trained; default input_ids) ->
    {"input_ids", "position_ids", "shift_labels"} [B, T / size]. The labels are shifted before the split (a rank's
    last label is the next rank's first one; -100 at the very end, and where a packed document ends)."""
    B, T = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(T, device=input_ids.device).unsqueeze(0)
    position_ids = position_ids.expand(B, T)
    shifted = torch.full_like(input_ids, -100)
    shifted[:, :-1] = (input_ids if labels is None else labels)[:, 1:]
    shifted[:, :-1][position_ids[:, 1:] != position_ids[:, :-1] + 1] = -100  # no label across a document start
    return {
        "input_ids": shard_sequence(input_ids, group),
        "position_ids": shard_sequence(position_ids, group),
        "shift_labels": shard_sequence(shifted, group),
    }


__all__ = [
    "context_parallel_batch",
    "context_parallel_group",
    "disable_context_parallel",
    "enable_context_parallel",
    "shard_sequence",
]
