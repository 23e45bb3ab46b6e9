"""What rank 0 of `kimi-hf finetune` reports: one JSON line per step `{"step": i, "loss": x}` and per evaluation
`{"step": i, "eval_loss": x}` on stdout (nothing else: tools parse it), a progress bar on stderr (tqdm), and, with a
log folder, TensorBoard event files (`torch.utils.tensorboard`: loss, eval_loss, learning rate, gradient norm) that
`tensorboard --logdir` reads. The other ranks report nothing."""

from __future__ import annotations

import json
import sys


def check_tensorboard(log_dir: str) -> None:
    """ValueError naming --log-dir when the tensorboard package (which torch.utils.tensorboard writes with) is not
    installed."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(f"--log-dir {log_dir}: TensorBoard event files need the tensorboard package") from None


def tensorboard_writer(log_dir: str):
    """A TensorBoard SummaryWriter on `log_dir` (`check_tensorboard` first)."""
    check_tensorboard(log_dir)
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=log_dir)


class Metrics:
    """Rank 0's reports of a run of `steps` steps starting at `start` (a resumed run's bar starts there)."""

    def __init__(self, rank: int, steps: int, start: int = 0, log_dir: str | None = None):
        self.on = rank == 0
        self.bar = self.writer = None
        if not self.on:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=steps, initial=start, desc="finetune", unit="step", file=sys.stderr, dynamic_ncols=True)
        if log_dir:
            self.writer = tensorboard_writer(log_dir)

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None = None) -> None:
        if not self.on:
            return
        print(json.dumps({"step": step, "loss": loss}), flush=True)
        shown = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}"}
        if grad_norm is not None:
            shown["grad_norm"] = f"{grad_norm:.3g}"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)
        if self.writer is not None:
            self.writer.add_scalar("train/loss", loss, step)
            self.writer.add_scalar("train/learning_rate", lr, step)
            if grad_norm is not None:
                self.writer.add_scalar("train/grad_norm", grad_norm, step)

    def eval(self, step: int, eval_loss: float) -> None:
        if not self.on:
            return
        print(json.dumps({"step": step, "eval_loss": eval_loss}), flush=True)
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", eval_loss, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


__all__ = ["Metrics", "check_tensorboard", "tensorboard_writer"]
