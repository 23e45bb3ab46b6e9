"""Learning-rate schedules of `kimi-hf finetune`: a linear warm-up, then constant, cosine or WSD (warm-up, stable,
decay), as a `torch.optim.lr_scheduler.LambdaLR` factor of the peak learning rate.

- constant: 1 after the warm-up;
- cosine: from 1 down to COSINE_FLOOR over the steps after the warm-up (the shape of transformers'
  `get_cosine_with_min_lr_schedule_with_warmup`, min_lr_rate 0.1);
- wsd: 1 until the last WSD_DECAY of the steps, then linearly down to 0 (MiniCPM's warm-up-stable-decay, which
  Moonshot's Kimi reports train with: a run can be extended from a stable checkpoint).

The warm-up moves at step 0 already: factor (step + 1) / (warmup + 1), so no step is wasted at lr 0.
"""

from __future__ import annotations

import math

import torch


SCHEDULES = ("constant", "cosine", "wsd")
COSINE_FLOOR = 0.1  # cosine ends at 10% of the peak
WSD_DECAY = 0.2  # wsd decays over the last 20% of the steps


def lr_factor(step: int, steps: int, warmup: int, schedule: str) -> float:
    """The factor of the peak learning rate at optimizer step `step` (0-based) of `steps`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, steps - warmup - 1)
        progress = min(1.0, (step - warmup) / span)
        return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))
    decay = max(1, round(WSD_DECAY * steps))
    start = max(warmup, steps - decay)
    if step < start:
        return 1.0
    return max(0.0, 1 - (step - start + 1) / (steps - start + 1))


def lr_scheduler(optimizer: torch.optim.Optimizer, steps: int, warmup: int, schedule: str):
    """LambdaLR of `lr_factor` (its state_dict holds the step: a resumed run continues the curve)."""
    lr_factor(0, steps, warmup, schedule)  # a bad schedule fails here, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps, warmup, schedule))


__all__ = ["COSINE_FLOOR", "SCHEDULES", "WSD_DECAY", "lr_factor", "lr_scheduler"]
