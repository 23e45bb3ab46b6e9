"""Image processor for the early-fusion model, on PIL + numpy + torch (no torchvision).

Kimi K2.5's policy (Kimi K2.5, arXiv 2602.02276; MoonViT as in Kimi-VL): never upscale; shrink so that the image has at most `max_patches`
patches and at most `max_patches_per_side` patches per side; pad (bottom/right, black) to multiples
of patch_size * merge_size; rescale by 1/255; normalise with mean = std = 0.5; cut into patches.

    KimiHybridImageProcessor()(images=[...], return_tensors="pt")
        -> pixel_values [sum of patches, 3, p, p] (float32), image_grid_thw [num_images, 3] = (1, h, w)
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os

import numpy as np
import torch
from PIL import Image
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature

from ..hub_kimi import RemoteCodeProcessorMixin


def _read_data_url(url: str, index: int) -> Image.Image:
    """A `data:image/...;base64,...` URL (as OpenAI-style chat requests send images) -> the decoded image."""
    head, _, payload = url.partition(",")
    if not head.endswith(";base64"):
        raise ValueError(f"images[{index}]: only base64 data: URLs are supported, got {head[:40]!r}")
    try:
        data = base64.b64decode(payload, validate=True)
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.copy()
    except (OSError, SyntaxError, ValueError, EOFError, binascii.Error) as err:
        raise ValueError(f"images[{index}]: cannot decode the image of data URL {head[:40]!r}...: {err}") from err


def _read_image_file(path, index: int) -> Image.Image:
    """Decodes an image file (or a base64 data: URL) completely (PIL decodes lazily: a truncated file would
    otherwise fail later, with an error that does not name it). Remote URLs are refused: nothing is downloaded."""
    if isinstance(path, str) and path.startswith("data:"):
        return _read_data_url(path, index)
    if isinstance(path, str) and path.startswith(("http://", "https://")):
        raise ValueError(
            f"images[{index}]: {path!r} is a remote URL; pass a local path, a data: URL or a PIL image "
            "(images are not downloaded)"
        )
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise  # these name the path already
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as err:  # truncated, corrupt
        raise ValueError(f"images[{index}]: cannot read image file {os.fspath(path)!r}: {err}") from err


def _as_image(image, index: int) -> Image.Image | np.ndarray:
    """Any supported image -> a (non-empty) PIL image, or a uint8 array [H, W, C] with C in 1, 3, 4."""
    if isinstance(image, (str, os.PathLike)):
        image = _read_image_file(image, index)
    if isinstance(image, Image.Image):
        if image.width == 0 or image.height == 0:
            raise ValueError(f"images[{index}] is empty ({image.width} x {image.height} pixels)")
        return image
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise TypeError(
            f"images[{index}] must be a PIL image, a numpy array, a torch tensor or a path, got {type(image).__name__}"
        )
    arr = image
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)  # channels first -> last
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"images[{index}] must be [H, W], [H, W, C] or [C, H, W] with C in 1, 3, 4; got shape {image.shape}"
        )
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"images[{index}] is empty (shape {image.shape})")
    if arr.dtype != np.uint8:
        arr = arr.astype(np.float32)
        if not np.isfinite(arr).all():
            raise ValueError(f"images[{index}] contains NaN or infinite values")
        if arr.max(initial=0.0) <= 1.0:  # float images in [0, 1]
            arr = arr * 255.0
        arr = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
    return arr


def _to_rgb_uint8(image, index: int) -> np.ndarray:
    """Any supported image -> [H, W, 3] uint8. Grayscale is replicated, alpha composited over white."""
    image = _as_image(image, index)
    if isinstance(image, Image.Image):
        if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(background, rgba)
        return np.asarray(image.convert("RGB"))
    arr = image
    if arr.shape[-1] == 1:
        arr = np.repeat(arr, 3, axis=-1)
    elif arr.shape[-1] == 4:
        alpha = arr[..., 3:].astype(np.float32) / 255.0
        arr = np.rint(arr[..., :3] * alpha + 255.0 * (1.0 - alpha)).astype(np.uint8)
    return arr


def _to_pil(image, index: int) -> Image.Image:
    """Any supported image -> a PIL image in its own mode (alpha kept)."""
    image = _as_image(image, index)
    if isinstance(image, Image.Image):
        return image
    return Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)


class KimiHybridImageProcessor(RemoteCodeProcessorMixin, BaseImageProcessor):
    model_input_names = ["pixel_values", "image_grid_thw"]

    def __init__(
        self,
        patch_size: int = 14,
        merge_size: int = 2,
        max_patches: int = 16384,
        max_patches_per_side: int = 512,
        image_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
        image_std: tuple[float, ...] = (0.5, 0.5, 0.5),
        rescale_factor: float = 1 / 255,
        **kwargs,
    ):
        super().__init__(**kwargs)
        for name, value in (
            ("patch_size", patch_size),
            ("merge_size", merge_size),
            ("max_patches", max_patches),
            ("max_patches_per_side", max_patches_per_side),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if len(image_mean) != 3 or len(image_std) != 3 or min(image_std) <= 0:
            raise ValueError(f"image_mean and image_std need 3 values (std > 0), got {image_mean}, {image_std}")
        self.patch_size, self.merge_size = patch_size, merge_size
        self.max_patches, self.max_patches_per_side = max_patches, max_patches_per_side
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.rescale_factor = rescale_factor

    def target_size(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """((resized h, w), (padded h, w)) for an image of height x width pixels (K2.5's rule)."""
        p = self.patch_size
        patches = max(1, height // p) * max(1, width // p)
        side = self.max_patches_per_side * p
        scale = min(1.0, math.sqrt(self.max_patches / patches), side / height, side / width)
        h, w = min(max(1, int(height * scale)), side), min(max(1, int(width * scale)), side)
        factor = p * self.merge_size
        return (h, w), (-(-h // factor) * factor, -(-w // factor) * factor)

    def get_number_of_image_patches(self, height: int, width: int, images_kwargs: dict | None = None) -> int:
        (_, _), (ph, pw) = self.target_size(height, width)
        return (ph // self.patch_size) * (pw // self.patch_size)

    def get_number_of_image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens the image takes in the text stream (one per merged patch group)."""
        return self.get_number_of_image_patches(height, width) // self.merge_size**2

    def _resized_rgb(self, image, index: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        """(the image resized by `target_size`, [h, w, 3] uint8; its original (height, width); the padded one)."""
        arr = _to_rgb_uint8(image, index)
        (h, w), padded = self.target_size(*arr.shape[:2])
        if (h, w) != arr.shape[:2]:
            return np.asarray(Image.fromarray(arr).resize((w, h), Image.BICUBIC)), arr.shape[:2], padded
        return arr, arr.shape[:2], padded

    def _normalize(self, x: np.ndarray) -> np.ndarray:
        """[h, w, 3] float32 pixel values in 0..255 -> rescaled and normalised."""
        return (x * self.rescale_factor - np.asarray(self.image_mean, np.float32)) / np.asarray(
            self.image_std, np.float32
        )

    def _one(self, image, index: int) -> tuple[np.ndarray, tuple[int, int, int], tuple[int, int]]:
        arr, size, (ph, pw) = self._resized_rgb(image, index)
        h, w = arr.shape[:2]
        padded = np.zeros((ph, pw, 3), dtype=np.float32)  # black padding, bottom and right
        padded[:h, :w] = arr
        x = self._normalize(padded)
        p = self.patch_size
        gh, gw = ph // p, pw // p
        patches = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3, p, p)
        return patches, (1, gh, gw), size

    def preprocess(
        self, images, return_tensors: str | None = "pt", return_image_sizes: bool = False, **kwargs
    ) -> BatchFeature:
        """images: an image or a list (nested lists are flattened in order). With `return_image_sizes`, also
        `image_sizes` [num_images, 2], each image's original (height, width) (the processor's K3 markup names it)."""
        if images is None or (isinstance(images, (list, tuple)) and len(images) == 0):
            raise ValueError("images is empty: pass one image or a list of images")
        if not isinstance(images, (list, tuple)):
            images = [images]
        flat = [im for item in images for im in (item if isinstance(item, (list, tuple)) else [item])]
        done = [self._one(im, i) for i, im in enumerate(flat)]
        data = {
            "pixel_values": np.concatenate([d[0] for d in done]),
            "image_grid_thw": np.asarray([d[1] for d in done], dtype=np.int64),
        }
        if return_image_sizes:
            data["image_sizes"] = np.asarray([d[2] for d in done], dtype=np.int64)
        return BatchFeature(data=data, tensor_type=return_tensors)

    def __call__(self, images=None, return_tensors: str | None = "pt", **kwargs) -> BatchFeature:
        return self.preprocess(images, return_tensors=return_tensors, **kwargs)


__all__ = ["KimiHybridImageProcessor"]
