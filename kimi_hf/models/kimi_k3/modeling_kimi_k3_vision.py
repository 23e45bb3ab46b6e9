"""Kimi K3's vision tower on its own (MoonViT3d with K3's switches: KimiHybridVisionModel built from a
KimiK3VisionConfig). Inside the multimodal model the tower is the same module; this class is what a saved K3
tower's auto_map names, so that `AutoModel.from_pretrained(tower_dir)` builds it with or without kimi_hf."""

from ..kimi_hybrid.modeling_kimi_hybrid_vision import KimiHybridVisionModel
from .configuration_kimi_k3_vision import KimiK3VisionConfig


class KimiK3VisionModel(KimiHybridVisionModel):
    """forward(pixel_values [N, 3, p, p], grid_thw [I, 3]) -> last_hidden_state [N, C], pooler_output
    [M, kh * kw, C], as KimiHybridVisionModel."""

    config: KimiK3VisionConfig
    config_class = KimiK3VisionConfig


__all__ = ["KimiK3VisionModel"]
