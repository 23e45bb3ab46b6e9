"""Kimi K3's image processor: K2.5's policy (KimiHybridImageProcessor) with K3's released media settings
(`media_proc_cfg`) and its fill of transparent pixels."""

from __future__ import annotations

import numpy as np
from PIL import Image

from ..kimi_hybrid.image_processing_kimi_hybrid import KimiHybridImageProcessor, _to_pil


# Kimi K3's media_proc_cfg (the release's preprocessor_config.json nests its settings under this key) -> ours
K3_MEDIA_PROC_KEYS = {
    "patch_size": "patch_size",
    "merge_kernel_size": "merge_size",
    "in_patch_limit": "max_patches",
    "patch_limit_on_one_side": "max_patches_per_side",
    "image_mean": "image_mean",
    "image_std": "image_std",
    "transparent_bg_config": "transparent_bg_config",
    "transparent_bg_fill_stage": "transparent_bg_fill_stage",
}
# K3's default background for transparent pixels: an 8-pixel chessboard of white (255, the top-left square)
# and gray (180)
K3_TRANSPARENT_BG = {
    "pattern": "chessboard",
    "chessboard_square_size": 8,
    "chessboard_square_on_top_left": True,
    "chessboard_white_value": 255,
    "chessboard_gray_value": 180,
}
TRANSPARENT_BG_PATTERNS = {"chessboard": None, "white": 255, "black": 0, "gray": 128}


def transparent_background(height: int, width: int, config: dict) -> np.ndarray:
    """[height, width, 3] uint8: what K3 puts behind transparent pixels (`transparent_bg_config`): a chessboard
    of `chessboard_square_size` squares, white (`chessboard_white_value`) at the top left when
    `chessboard_square_on_top_left`, else gray (`chessboard_gray_value`); or a plain white / black / gray."""
    pattern = config.get("pattern", "chessboard")
    if pattern != "chessboard":
        return np.full((height, width, 3), TRANSPARENT_BG_PATTERNS[pattern], dtype=np.uint8)
    square = config["chessboard_square_size"]
    rows = np.arange(height)[:, None] // square
    cols = np.arange(width)[None, :] // square
    gray = (rows + cols) % 2 == (1 if config["chessboard_square_on_top_left"] else 0)
    out = np.full((height, width, 3), config["chessboard_white_value"], dtype=np.uint8)
    out[gray] = config["chessboard_gray_value"]
    return out


def fill_transparent(image: Image.Image, config: dict) -> Image.Image:
    """An RGB image: `image` itself if RGB, converted if it has no transparency, else composited over
    `transparent_background` as K3 does (alpha * rgb + (1 - alpha) * background in float32, truncated)."""
    if image.mode == "RGB":
        return image
    if "A" not in image.getbands() and "transparency" not in image.info:
        return image.convert("RGB")
    rgba = np.asarray(image.convert("RGBA"))
    background = transparent_background(rgba.shape[0], rgba.shape[1], config)
    alpha = rgba[:, :, 3:4].astype(np.float32) / 255.0
    return Image.fromarray((alpha * rgba[:, :, :3] + (1.0 - alpha) * background).astype(np.uint8))


class KimiK3ImageProcessor(KimiHybridImageProcessor):
    """Kimi K3's image processor (the release's `KimiK3VisionProcessor`): K2.5's rule with K3's budget of 65,536
    patches (at most 512 a side), transparent pixels over a chessboard (`transparent_bg_config`), filled after
    the resize by default (`transparent_bg_fill_stage`: "after_resize" keeps the squares crisp,
    "before_resize" blends them into resampled edges), pixels / 255 - mean, times 1 / std.

    Reads the release's preprocessor_config.json, whose settings are nested under `media_proc_cfg`
    (`in_patch_limit`, `patch_limit_on_one_side`, `merge_kernel_size`, ...), as well as its own flat ones.

        KimiK3ImageProcessor()(images=[...]) -> pixel_values [sum of patches, 3, 14, 14], image_grid_thw [n, 3]
    """

    def __init__(
        self,
        patch_size: int = 14,
        merge_size: int = 2,
        max_patches: int = 65536,
        max_patches_per_side: int = 512,
        image_mean: tuple[float, ...] = (0.5, 0.5, 0.5),
        image_std: tuple[float, ...] = (0.5, 0.5, 0.5),
        transparent_bg_config: dict | None = None,
        transparent_bg_fill_stage: str = "after_resize",
        media_proc_cfg: dict | None = None,
        **kwargs,
    ):
        settings = {
            "patch_size": patch_size,
            "merge_size": merge_size,
            "max_patches": max_patches,
            "max_patches_per_side": max_patches_per_side,
            "image_mean": image_mean,
            "image_std": image_std,
            "transparent_bg_config": transparent_bg_config,
            "transparent_bg_fill_stage": transparent_bg_fill_stage,
        }
        for key, value in (media_proc_cfg or {}).items():
            if key == "fixed_output_tokens":
                if value is not None:  # K3's code then counts tokens that the features do not match
                    raise ValueError(f"media_proc_cfg.fixed_output_tokens={value!r} is not supported (only null)")
            elif key in K3_MEDIA_PROC_KEYS:
                settings[K3_MEDIA_PROC_KEYS[key]] = value
            # other keys (video settings such as temporal_merge_kernel_size) do not apply to images
        kwargs.pop("auto_map", None)  # the release's points at its own remote code
        background = dict(K3_TRANSPARENT_BG, **(settings.pop("transparent_bg_config") or {}))
        if background.get("pattern") not in TRANSPARENT_BG_PATTERNS:
            raise ValueError(
                f"transparent_bg_config.pattern must be one of {sorted(TRANSPARENT_BG_PATTERNS)}, "
                f"got {background.get('pattern')!r}"
            )
        stage = settings.pop("transparent_bg_fill_stage")
        if stage not in ("before_resize", "after_resize"):
            raise ValueError(f"transparent_bg_fill_stage must be 'before_resize' or 'after_resize', got {stage!r}")
        super().__init__(**settings, **kwargs)
        self.transparent_bg_config, self.transparent_bg_fill_stage = background, stage

    def _resized_rgb(self, image, index: int) -> tuple[np.ndarray, tuple[int, int], tuple[int, int]]:
        image = _to_pil(image, index)
        size = (image.height, image.width)
        (h, w), padded = self.target_size(*size)
        # K3 resizes even at scale 1 (PIL then returns a copy) and in the image's own mode (alpha kept)
        if self.transparent_bg_fill_stage == "before_resize":
            image = fill_transparent(image, self.transparent_bg_config).resize((w, h), Image.BICUBIC)
        else:
            image = fill_transparent(image.resize((w, h), Image.BICUBIC), self.transparent_bg_config)
        return np.asarray(image), size, padded

    def _normalize(self, x: np.ndarray) -> np.ndarray:
        # K3's order of operations, in place in float32: x / 255, minus the mean, times the inverse of the std
        x = x / np.float32(1.0 / self.rescale_factor)
        x -= np.asarray(self.image_mean, np.float64)
        x *= 1.0 / np.asarray(self.image_std, np.float64)
        return x


__all__ = ["K3_MEDIA_PROC_KEYS", "KimiK3ImageProcessor", "fill_transparent", "transparent_background"]
