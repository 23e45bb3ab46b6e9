"""Configuration of the MoonViT-style vision tower (Kimi K2.5's field names and defaults)."""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig


@strict
class KimiHybridVisionConfig(PreTrainedConfig):
    r"""
    MoonViT-style vision tower (Kimi K2.5's field names and defaults): patch_size x patch_size patches
    at native resolution, a learned pos_emb_height x pos_emb_width position table resampled
    bicubically to each image, a sinusoid per frame for video (pos_emb_time), axial 2D RoPE over the
    whole head (rope_parameters: rope_type "axial", rope_theta), pre-LN blocks, then
    merge_kernel_size patches merged into one token.
    """

    model_type = "kimi_hybrid_vision"
    base_config_key = "vision_config"

    patch_size: int = 14
    hidden_size: int = 1152
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    merge_kernel_size: tuple[int, int] | list[int] = (2, 2)
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    rope_parameters: dict | None = None
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02

    def __post_init__(self, **kwargs):
        self.merge_kernel_size = list(self.merge_kernel_size)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "axial", "rope_theta": 10000.0}
        self._validate()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        self._validate()

    def _validate(self):
        for name in (
            "patch_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "pos_emb_height",
            "pos_emb_width",
            "pos_emb_time",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) / num_attention_heads ({self.num_attention_heads}) must be "
                "an integer head size divisible by 4 (axial 2D RoPE)"
            )
        mk = self.merge_kernel_size
        if len(mk) != 2 or any(not isinstance(m, int) or m < 1 for m in mk):
            raise ValueError(f"merge_kernel_size must be two positive integers, got {mk!r}")
        if self.rope_parameters.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"rope_parameters.rope_type must be 'axial', got {self.rope_parameters.get('rope_type')!r}"
            )


__all__ = ["KimiHybridVisionConfig"]
