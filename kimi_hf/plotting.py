"""Loss curves for the quickstart and the examples: a Trainer callback that records them and a PNG
writer that needs only Pillow (an install requirement; matplotlib is not)."""

from __future__ import annotations

import io
import math
import os

from PIL import Image, ImageDraw
from transformers import TrainerCallback

from .atomic_io import atomic_write


class LossHistory(TrainerCallback):
    """Records (step, loss) from the Trainer's logs."""

    def __init__(self):
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and math.isfinite(float(logs["loss"])):
            self.steps.append(state.global_step)
            self.losses.append(float(logs["loss"]))


def save_loss_plot(
    path: str, steps: list[int], losses: list[float], title: str = "training loss", size: tuple[int, int] = (640, 400)
) -> str:
    """A line plot of losses over steps as PNG (written atomically, mode 0o666 & ~umask). Returns path."""
    if len(steps) != len(losses):
        raise ValueError(f"steps and losses differ in length: {len(steps)} vs {len(losses)}")
    if not steps:
        raise ValueError("losses is empty: nothing to plot (log more often than every run)")
    w, h = size
    left, right, top, bottom = 60, 20, 30, 40
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    lo, hi = min(losses), max(losses)
    hi = hi if hi > lo else lo + 1.0
    s0, s1 = min(steps), max(steps)
    s1 = s1 if s1 > s0 else s0 + 1

    def xy(step, loss):
        return (
            left + (step - s0) / (s1 - s0) * (w - left - right),
            top + (hi - loss) / (hi - lo) * (h - top - bottom),
        )

    draw.rectangle([left, top, w - right, h - bottom], outline="black")
    for i in range(5):  # y ticks
        v = lo + (hi - lo) * i / 4
        y = xy(s0, v)[1]
        draw.line([left - 4, y, left, y], fill="black")
        draw.text((4, y - 6), f"{v:.2f}", fill="black")
    for s in (s0, (s0 + s1) // 2, s1):  # x ticks
        x = xy(s, lo)[0]
        draw.line([x, h - bottom, x, h - bottom + 4], fill="black")
        draw.text((x - 10, h - bottom + 8), str(s), fill="black")
    draw.text((left, 8), title, fill="black")
    draw.text((w // 2 - 10, h - 16), "step", fill="black")
    points = [xy(s, v) for s, v in zip(steps, losses)]
    if len(points) > 1:
        draw.line(points, fill=(31, 119, 180), width=2)
    for x, y in points if len(points) == 1 else []:
        draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=(31, 119, 180))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    png = io.BytesIO()
    img.save(png, format="PNG")
    return atomic_write(path, png.getvalue())


__all__ = ["LossHistory", "save_loss_plot"]
