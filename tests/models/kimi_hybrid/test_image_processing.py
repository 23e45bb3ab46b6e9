"""KimiHybridImageProcessor: K2.5's resize policy, the input types it accepts, its errors, save/load."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from kimi_hf import KimiHybridImageProcessor


def rgb(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_output_layout_and_values():
    ip = KimiHybridImageProcessor()
    img = rgb(56, 84)  # exactly 4 x 6 patches, multiples of 28: no resize, no padding
    out = ip(images=[img], return_tensors="pt")
    assert out["pixel_values"].shape == (24, 3, 14, 14) and out["pixel_values"].dtype == torch.float32
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    arr = (np.asarray(img, np.float32) / 255 - 0.5) / 0.5
    # patch (1, 2): rows 14..27, columns 28..41, channels first
    assert np.allclose(out["pixel_values"][1 * 6 + 2].numpy(), arr[14:28, 28:42].transpose(2, 0, 1), atol=1e-6)


def test_never_upscales_and_pads_to_patch_times_merge():
    ip = KimiHybridImageProcessor()
    out = ip(images=[rgb(30, 50)])  # small image: kept at 30 x 50, padded to 56 x 56
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    padded = out["pixel_values"].view(4, 4, 3, 14, 14)
    assert torch.all(padded[3, :, :, :, :] == -1.0)  # the padding row is black (-1 after normalisation)
    assert ip.target_size(30, 50) == ((30, 50), (56, 56))


def test_patch_budget_and_per_side_limit():
    ip = KimiHybridImageProcessor(max_patches=64, max_patches_per_side=10)
    (h, w), (ph, pw) = ip.target_size(1400, 700)  # 100 x 50 patches: shrink to <= 64 patches
    assert (h // 14) * (w // 14) <= 64 and h <= 140 and ph % 28 == 0 and pw % 28 == 0
    (h, w), _ = ip.target_size(14 * 40, 14 * 2)  # tall: the per-side limit binds
    assert h <= 140
    out = ip(images=[rgb(1400, 700)])
    t, gh, gw = out["image_grid_thw"][0].tolist()
    assert out["pixel_values"].shape[0] == gh * gw and gh * gw <= 64 + 2 * 10


def test_accepts_pil_numpy_torch_paths_gray_and_rgba(tmp_path):
    ip = KimiHybridImageProcessor()
    base = np.random.default_rng(1).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    path = tmp_path / "x.png"
    Image.fromarray(base).save(path)
    inputs = [
        Image.fromarray(base),
        base,
        base.transpose(2, 0, 1),
        torch.from_numpy(base.transpose(2, 0, 1)),
        base.astype(np.float32) / 255.0,
        str(path),
        path,
    ]
    outs = [ip(images=[x])["pixel_values"] for x in inputs]
    for o in outs[1:]:
        assert torch.allclose(o, outs[0], atol=1e-2)
    gray = ip(images=[Image.fromarray(base[..., 0])])["pixel_values"]
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])
    rgba = np.concatenate([base, np.zeros((28, 28, 1), np.uint8)], -1)  # fully transparent: white
    assert torch.all(ip(images=[Image.fromarray(rgba, "RGBA")])["pixel_values"] == 1.0)
    assert torch.all(ip(images=[rgba])["pixel_values"] == 1.0)


@pytest.mark.parametrize(
    "images,exc,match",
    [
        ([], ValueError, "empty"),
        ([np.zeros((0, 5, 3), np.uint8)], ValueError, "empty"),
        ([np.full((5, 5, 3), np.nan, np.float32)], ValueError, "NaN"),
        ([np.zeros((5, 5, 2), np.uint8)], ValueError, "shape"),
        (["not an image", 3], TypeError, r"images\[1\]"),
    ],
)
def test_bad_images_raise(images, exc, match, tmp_path):
    if images and isinstance(images[0], str):
        images[0] = str(tmp_path / "a.png")
        Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(images[0])
    with pytest.raises(exc, match=match):
        KimiHybridImageProcessor()(images=images)


def test_bad_settings_raise_and_settings_round_trip(tmp_path):
    with pytest.raises(ValueError, match="merge_size"):
        KimiHybridImageProcessor(merge_size=0)
    ip = KimiHybridImageProcessor(max_patches=1000)
    ip.save_pretrained(tmp_path)
    import kimi_hf  # noqa: F401  (registers the Auto classes)

    loaded = AutoImageProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, KimiHybridImageProcessor) and loaded.max_patches == 1000


@pytest.mark.parametrize("damage", ["truncated", "not_an_image"])
def test_unreadable_image_file_raises_naming_it(tmp_path, damage):
    """PIL decodes lazily: a truncated PNG failed later with "image file is truncated" and no file name."""
    import re

    path = tmp_path / "scene.png"
    rgb(64, 64, seed=3).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"hello, not a PNG")
    with pytest.raises(ValueError, match=r"images\[1\]: cannot read image file .*" + re.escape(str(path))):
        KimiHybridImageProcessor()(images=[rgb(28, 28), path])


def test_data_urls_decode_and_remote_urls_are_refused():
    """`kimi-hf serve` hands OpenAI `image_url` parts (data: URLs) to the processor as strings."""
    import base64
    import io

    image = rgb(56, 28, seed=4)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    proc = KimiHybridImageProcessor()
    a, b = proc(images=[url], return_tensors="pt"), proc(images=[image], return_tensors="pt")
    assert torch.equal(a["pixel_values"], b["pixel_values"]) and a["image_grid_thw"].tolist() == [[1, 4, 2]]
    with pytest.raises(ValueError, match=r"images\[0\]: cannot decode the image of data URL"):
        proc(images=["data:image/png;base64,aGVsbG8="])
    with pytest.raises(ValueError, match="remote URL"):
        proc(images=["https://example.com/cat.png"])
