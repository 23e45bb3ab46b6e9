"""transformers Trainer integration: MuonClip's QK-Clip statistics in the Trainer's logs."""

from __future__ import annotations

from transformers import TrainerCallback


def _unwrap(optimizer):
    """accelerate wraps the optimizer (AcceleratedOptimizer.optimizer)."""
    while hasattr(optimizer, "optimizer") and not hasattr(optimizer, "qk_clip"):
        optimizer = optimizer.optimizer
    return optimizer


class MuonClipCallback(TrainerCallback):
    """Adds `qk_max_logit` (largest pre-softmax logit over all heads since the last log) and
    `qk_clipped_heads` (head clips since the last log) to the Trainer's logs and log_history.

        Trainer(model, args, optimizers=(MuonClip.from_model(model), None), callbacks=[MuonClipCallback()])
    """

    def __init__(self):
        self._max = None
        self._clipped = 0

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        qk = getattr(_unwrap(optimizer), "qk_clip", None) if optimizer is not None else None
        if qk is not None and qk.last_max_logit is not None:
            self._max = qk.last_max_logit if self._max is None else max(self._max, qk.last_max_logit)
            self._clipped += qk.last_clipped_heads

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or self._max is None or "loss" not in logs:
            return
        extra = {"qk_max_logit": round(self._max, 4), "qk_clipped_heads": self._clipped}
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)
        self._max, self._clipped = None, 0
