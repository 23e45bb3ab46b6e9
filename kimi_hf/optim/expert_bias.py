"""Auxiliary-loss-free load balancing of the routed experts (DeepSeek-V3, arXiv 2412.19437 §2.1.2), as Kimi K3's
routers are built for (`topk_method: noaux_tc`, `e_score_correction_bias`): the bias only changes which experts
are chosen (never the weights), and after each optimizer step it moves by a fixed rate against each expert's
load,

    b_e <- b_e + update_rate * sign(mean_load - load_e)

so that overloaded experts get chosen less and idle ones more, without a loss term that pulls on the model.
The routers count their tokens while `track_load` is on (the forward of a training step; a gradient-checkpointing
recompute is not counted again); across processes the counts are summed first, so every rank applies the same
update.

    trainer = Trainer(model, args, ..., callbacks=[ExpertBiasCallback(update_rate=1e-3)])
    # or, in a custom loop: track_expert_load(model); ...; loss.backward(); opt.step(); update_expert_bias(model)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def expert_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers that carry an `e_score_correction_bias` and count their load (`expert_load`)."""
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias") and hasattr(m, "expert_load")]


def track_expert_load(model: nn.Module, enabled: bool = True) -> list[nn.Module]:
    """Turns load counting on (or off) in every router of `model` and clears the counts; returns the routers."""
    routers = expert_routers(model)
    for router in routers:
        router.track_load = enabled
        router.expert_load.zero_()
    return routers


def check_update_rate(update_rate) -> None:
    """The balancing rate must be a non-negative number (a ValueError naming it otherwise)."""
    if not isinstance(update_rate, (int, float)) or isinstance(update_rate, bool) or update_rate < 0:
        raise ValueError(f"update_rate must be a non-negative number, got {update_rate!r}")


@torch.no_grad()
def update_expert_bias(model: nn.Module, update_rate: float = 1e-3, group=None) -> dict:
    """One balancing step over every router of `model` (counts summed across the processes of `group`, the
    world by default, when torch.distributed is initialised; under pipeline parallelism the ranks of one stage),
    then clears the counts. Returns {"expert_load_imbalance": the largest max-load / mean-load
    over the routers that saw tokens, "routers": how many were updated}."""
    check_update_rate(update_rate)
    routers = [r for r in expert_routers(model) if r.track_load]
    if not routers:
        return {"expert_load_imbalance": None, "routers": 0}
    loads = torch.stack([r.expert_load for r in routers])  # [R, E] (one all-reduce for all of them)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    imbalance, updated = None, 0
    for router, load in zip(routers, loads):
        if load.sum() > 0:
            mean = load.mean()
            router.e_score_correction_bias += update_rate * torch.sign(mean - load)
            ratio = (load.max() / mean).item()
            imbalance = ratio if imbalance is None else max(imbalance, ratio)
            updated += 1
        router.expert_load.zero_()
    return {"expert_load_imbalance": imbalance, "routers": updated}


__all__ = ["check_update_rate", "expert_routers", "track_expert_load", "update_expert_bias"]
