import os
import stat
from types import SimpleNamespace

import pytest
from PIL import Image

from kimi_hf.plotting import LossHistory, save_loss_plot


def test_loss_plot_is_a_png_with_the_curve(tmp_path):
    path = save_loss_plot(str(tmp_path / "sub" / "loss.png"), [1, 2, 3, 4], [4.0, 3.0, 2.5, 2.4])
    img = Image.open(path)
    assert img.format == "PNG" and img.size == (640, 400)
    assert any(px == (31, 119, 180) for px in img.getdata())  # the line is drawn
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["loss.png"]  # no temp file left
    one = save_loss_plot(str(tmp_path / "one.png"), [5], [1.0])  # a single point: a dot of the curve's colour
    with Image.open(one) as img:
        dot = [px for px in img.convert("RGB").getdata() if px == (31, 119, 180)]
        # at the plot's left edge (step 5 of 5..6) and bottom (the lowest loss), 5 x 5 pixels at most
        assert img.getpixel((60, 360)) == (31, 119, 180) and 0 < len(dot) <= 25


def test_bad_inputs():
    with pytest.raises(ValueError, match="differ in length"):
        save_loss_plot("x.png", [1, 2], [1.0])
    with pytest.raises(ValueError, match="empty"):
        save_loss_plot("x.png", [], [])


def test_loss_history_keeps_finite_losses():
    h = LossHistory()
    for step, logs in ((1, {"loss": 2.0}), (2, {"grad_norm": 1.0}), (3, {"loss": float("nan")}), (4, {"loss": "1.5"})):
        h.on_log(None, SimpleNamespace(global_step=step), None, logs=logs)
    assert (h.steps, h.losses) == ([1, 4], [2.0, 1.5])


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_loss_plot_gets_normal_permissions(tmp_path, umask, mode):
    """Written through a temp file (mkstemp's 0600) and renamed, but with open()'s mode under the umask."""
    old = os.umask(umask)
    try:
        path = save_loss_plot(str(tmp_path / "loss.png"), [1, 2], [2.0, 1.0])
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode
