"""Configuration of the MoonViT vision tower (Kimi-VL, arXiv 2504.07491) and of its projector into the text
stream: Kimi K2.5's tower by default (transformers' kimi_k25 field names and defaults); Kimi K3's tower as options
of the same class. `KimiK3VisionConfig` reads and writes Kimi K3's released `vision_config` spelling."""

import functools

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig


NORM_TYPES = ("layernorm", "rmsnorm")
INTERPOLATION_MODES = ("bicubic", "bilinear")
# "axial": transformers' kimi_k25 layout (separate q/k/v projections, q/k rows in rotate-half order).
# "interleaved_2d": Moonshot's own MoonViT layout (the K2.5 and K3 releases): one fused qkv projection, q/k rows
# in complex-pair order. Both rotate the same angles; the q/k rows of one are a per-head permutation of the other's.
ROPE_TYPES = ("axial", "interleaved_2d")
PROJECTOR_TYPES = ("patchmerger", "patchmergerv2")

# Moonshot's released MoonViT vision_config spelling (Kimi K3's; K2.5's is a subset) -> the field of
# KimiHybridVisionConfig holding it.
MOONSHOT_RENAMED_FIELDS = {
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
    "vt_hidden_size": "hidden_size",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads",
    "vt_intermediate_size": "intermediate_size",
    "attn_bias": "attention_bias",
    "linear_bias": "mlp_bias",
    "patch_embed_proj_bias": "patch_embed_bias",
    "activation_func": "hidden_act",
    "mm_projector_type": "projector_type",
    "projector_ln_eps": "projector_layer_norm_eps",
}
# Released fields that name a variant of the architecture: the one value this tower implements.
MOONSHOT_FIXED_FIELDS = {
    "pos_emb_type": ("divided_fixed",),  # learned [H, W, C] table + fixed sin/cos per frame
    "mlp_type": ("mlp2",),  # fc0 -> act -> fc1
    "merge_type": ("sd2_tpool",),  # 2 x 2 spatial groups, mean over frames
    "projector_hidden_act": ("gelu",),  # the official projector hard-codes nn.GELU() (exact erf)
    "video_attn_type": ("spatial_temporal",),  # K2.5's key (dropped by K3): a video attends over all its frames
}
# Keys only Moonshot's spelling has: a KimiHybridVisionConfig given them would silently build K2.5's tower.
_MOONSHOT_ONLY = (
    set(MOONSHOT_RENAMED_FIELDS) | set(MOONSHOT_FIXED_FIELDS) | {"mm_hidden_size", "text_hidden_size"}
) - {"video_attn_type"}
# Generic keys transformers (or its older versions) writes into every config.json: not architecture (one list for
# the text and vision configs; each adds the keys only it receives)
TRANSFORMERS_GENERIC_FIELDS = frozenset(
    {
        "add_cross_attention",
        "architectures",
        "attn_implementation",
        "auto_map",
        "bad_words_ids",
        "begin_suppress_tokens",
        "chunk_size_feed_forward",
        "cross_attention_hidden_size",
        "decoder_start_token_id",
        "diversity_penalty",
        "do_sample",
        "dtype",
        "early_stopping",
        "encoder_no_repeat_ngram_size",
        "experts_implementation",
        "exponential_decay_length_penalty",
        "finetuning_task",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "id2label",
        "is_decoder",
        "is_encoder_decoder",
        "label2id",
        "length_penalty",
        "max_length",
        "min_length",
        "name_or_path",
        "no_repeat_ngram_size",
        "num_beam_groups",
        "num_beams",
        "num_labels",
        "num_return_sequences",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "prefix",
        "problem_type",
        "pruned_heads",
        "remove_invalid_values",
        "repetition_penalty",
        "return_dict",
        "return_dict_in_generate",
        "sep_token_id",
        "suppress_tokens",
        "task_specific_params",
        "temperature",
        "tf_legacy_loss",
        "tie_encoder_decoder",
        "tokenizer_class",
        "top_k",
        "top_p",
        "torch_dtype",
        "torchscript",
        "transformers_version",
        "typical_p",
        "use_bfloat16",
    }
)
# Attributes set on a config instance beyond its class's own (users and transformers' tests add some, e.g.
# `layer_norm_eps` on every sub-config): Kimi K3's configs write them after the released fields and list their names
# under this key, so that reading back what we wrote never meets the strictness meant for foreign config.json fields.
EXTRA_ATTRIBUTES_KEY = "kimi_hf_extra_attributes"


@functools.cache
def _class_attribute_names(cls) -> frozenset:
    return frozenset(vars(cls()))


def extra_attributes(config) -> dict:
    """{name: value} of the attributes `config` holds beyond what an instance of its class has by default, other
    than transformers' generic ones (a release's config.json carries transformers 4.x's: `prefix`, `tokenizer_class`,
    ...; the released spelling leaves them out), `auto_map` and `model_type`."""
    names = _class_attribute_names(type(config)) | TRANSFORMERS_GENERIC_FIELDS | {"auto_map", "model_type"}
    extras = {k: v for k, v in vars(config).items() if k not in names and not k.startswith("_")}
    kept = dict.fromkeys(extras)  # what transformers never serialises (distributed_config, the plans, ...) goes
    config._remove_keys_not_serialized(kept)
    return {k: extras[k] for k in kept}


def with_extra_attributes(config, out: dict) -> dict:
    """`out` (a released-spelling dict of config) plus config's extra attributes, named under EXTRA_ATTRIBUTES_KEY."""
    extras = {k: v for k, v in extra_attributes(config).items() if k not in out}
    if extras:
        out.update(extras)
        out[EXTRA_ATTRIBUTES_KEY] = sorted(extras)
    return out


_GENERIC_FIELDS = TRANSFORMERS_GENERIC_FIELDS | {
    "bos_token_id",
    "eos_token_id",
    "model_type",
    "pad_token_id",
    "per_layer_config",
    "tie_word_embeddings",
}


# model_type -> a registered variant of KimiHybridVisionConfig (see __init_subclass__)
_VARIANTS: dict[str, type] = {}


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@strict
class KimiHybridVisionConfig(PreTrainedConfig):
    r"""
    MoonViT vision tower (Kimi-VL, arXiv 2504.07491) and its projector. Defaults: Kimi K2.5's tower, in
    transformers' kimi_k25 field names. patch_size x patch_size patches at native resolution; a learned
    pos_emb_height x pos_emb_width position table resampled to each image; a sinusoid per frame for video
    (pos_emb_time); 2D RoPE; pre-norm blocks; merge_kernel_size patches merged into one token, then projected.

    Options (defaults = K2.5; Kimi K3's value in brackets, see `KimiK3VisionConfig`):
        norm_type (`str`): "layernorm" (nn.LayerNorm with bias, eps `layer_norm_eps`) or "rmsnorm" (nn.RMSNorm,
            eps `rms_norm_eps`) for norm1, norm2 and final_layernorm. ["rmsnorm"]
        rms_norm_eps (`float | None`): None = PyTorch's nn.RMSNorm(dim) default, torch.finfo(input dtype).eps
            at run time (2^-7 in bf16, ~1.19e-7 in fp32): K3 builds its vision norms without an eps. [None]
        attention_bias, mlp_bias, patch_embed_bias (`bool`): biases of the qkv/output projections, of fc1/fc2,
            of the patch-embedding conv. [False, False, False]
        qkv_hidden_size (`int | None`): width of q, k and v (heads x head_dim); None = hidden_size. head_dim =
            qkv_hidden_size / num_attention_heads; the output projection maps it back to hidden_size. [1536]
        pos_emb_interpolation_mode (`str`): "bicubic" or "bilinear" (align_corners=False) resampling of the
            position table to an image's h x w. ["bilinear"]
        rope_parameters (`dict`): {"rope_type", "rope_theta"}; the angles are the same for both types: head_dim / 4
            frequencies theta^(-4 i / head_dim), slot 2 i rotated by column (width) index x freq_i, slot 2 i + 1
            by row index x freq_i. rope_type selects the layout:
            "axial" (transformers' kimi_k25): q_proj / k_proj / v_proj, the head rotated in rotate-half order.
            "interleaved_2d" (Moonshot's MoonViT, the K2.5 and K3 releases): one fused qkv_proj
                [3 x qkv_hidden_size, hidden] (rows: q, k, v, each (heads, head_dim)), and adjacent real pairs
                (2 j, 2 j + 1) of q / k rotated as complex numbers by slot j's angle (view_as_complex).
            ["interleaved_2d", theta 10000]
        projector_type (`str`): "patchmerger" (K2.5: LayerNorm per patch, Linear + bias, GELU, Linear + bias) or
            "patchmergerv2" (K3: Linear(4 C, 4 C) proj.0, exact GELU, Linear(4 C, text hidden) proj.2, no biases,
            then post_norm = RMSNorm(text hidden)). ["patchmergerv2"]
        projector_layer_norm_eps (`float | None`): eps of the projector's norm; None = the layer_norm_eps the
            multimodal model passes to `build_multimodal_projector` (its projection_layer_norm_eps). [1e-5]

    A `_attn_implementation` key (Kimi K3's release says "flash_attention_2") is ignored: the attention
    implementation is a run-time choice (`attn_implementation=` at load; eager / SDPA by default, so CPU works).
    """

    model_type = "kimi_hybrid_vision"
    base_config_key = "vision_config"
    # no FSDP2 units of its own under transformers' FSDP2 at load: the tower stays in the root unit, gathered by
    # every rank at every step (a unit per vision layer all-gathers only on ranks whose batch has an image, and the
    # collectives of ranks with and without images would not match; docs/parallelism.md)
    base_model_fsdp_plan = {}
    default_rope_type = "axial"

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
    norm_type: str = "layernorm"
    rms_norm_eps: float | None = None
    attention_bias: bool = True
    mlp_bias: bool = True
    patch_embed_bias: bool = True
    qkv_hidden_size: int | None = None
    pos_emb_interpolation_mode: str = "bicubic"
    projector_type: str = "patchmerger"
    projector_layer_norm_eps: float | None = None

    def __new__(cls, *args, **kwargs):
        # A saved Kimi K3 tower's config (model_type "kimi_k3_vision", K3's spelling) read through this class, as
        # KimiHybridVisionModel.from_pretrained and a composite config's vision_config spec do, builds the K3
        # config. Only the model_type decides: a dict without one in Moonshot's spelling raises (see __post_init__).
        if cls is KimiHybridVisionConfig:
            cls = _VARIANTS.get(kwargs.get("model_type"), cls)
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs):
        # variants (Kimi K3's tower) register their model_type, so that this class builds them from a saved config
        # without importing them (data flows one way: the variant imports this file)
        super().__init_subclass__(**kwargs)
        if "model_type" in vars(cls):
            _VARIANTS[cls.model_type] = cls

    def __post_init__(self, **kwargs):
        # Kimi K3's released vision_config carries "_attn_implementation": "flash_attention_2"; honouring it would
        # force flash attention (no CPU run), so it is dropped: the implementation is chosen at load time.
        kwargs.pop("_attn_implementation", None)
        moonshot = sorted(set(kwargs) & _MOONSHOT_ONLY)
        if moonshot:
            raise ValueError(
                f"vision_config fields {moonshot} are Moonshot's spelling (Kimi K3's released vision_config): "
                "read such a dict with KimiK3VisionConfig"
            )
        self.merge_kernel_size = list(self.merge_kernel_size)
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": self.default_rope_type, "rope_theta": 10000.0}
        self._validate()
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        self._validate()

    def _validate_interleaved_2d_rope_parameters(self, rope_parameters: dict, ignore_keys: set | None = None):
        """transformers' RoPE validation hook for rope_type "interleaved_2d" (keys as for the default RoPE)."""
        self._validate_default_rope_parameters(rope_parameters, ignore_keys=ignore_keys)

    def qkv_size(self) -> int:
        """Width of q, k and v: qkv_hidden_size, or hidden_size when it is None."""
        return self.qkv_hidden_size if self.qkv_hidden_size is not None else self.hidden_size

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
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        q = self.qkv_hidden_size
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or q < 1):
            raise ValueError(f"qkv_hidden_size must be None or a positive integer, got {q!r}")
        width = "hidden_size" if q is None else "qkv_hidden_size"
        heads = self.num_attention_heads
        if self.qkv_size() % heads or (self.qkv_size() // heads) % 4:
            raise ValueError(
                f"{width} ({self.qkv_size()}) / num_attention_heads ({heads}) must be an integer head size "
                "divisible by 4 (2D RoPE: head_dim / 4 frequencies per axis)"
            )
        mk = self.merge_kernel_size
        if len(mk) != 2 or any(not isinstance(m, int) or m < 1 for m in mk):
            raise ValueError(f"merge_kernel_size must be two positive integers, got {mk!r}")
        for name, allowed in (
            ("norm_type", NORM_TYPES),
            ("pos_emb_interpolation_mode", INTERPOLATION_MODES),
            ("projector_type", PROJECTOR_TYPES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not _positive(self.layer_norm_eps):
            raise ValueError(f"layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}")
        for name in ("rms_norm_eps", "projector_layer_norm_eps"):
            if getattr(self, name) is not None and not _positive(getattr(self, name)):
                raise ValueError(f"{name} must be None or a positive number, got {getattr(self, name)!r}")
        rope_type = self.rope_parameters.get("rope_type", self.default_rope_type)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters.rope_type must be one of {list(ROPE_TYPES)}, got {rope_type!r}")
        theta = self.rope_parameters.get("rope_theta", 10000.0)
        if not _positive(theta):
            raise ValueError(f"rope_parameters.rope_theta must be a positive number, got {theta!r}")


__all__ = [
    "EXTRA_ATTRIBUTES_KEY",
    "KimiHybridVisionConfig",
    "extra_attributes",
    "with_extra_attributes",
]
