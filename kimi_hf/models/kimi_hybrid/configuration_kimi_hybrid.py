"""Configuration of the hybrid KDA/MLA text model (Kimi Linear layout).

Reads three spellings of the same model: ours, transformers' native `kimi_linear` (num_local_experts,
n_group, mlp_layer_types, linear_num_heads, ...) and Moonshot's original config.json
(`linear_attn_config` with 1-based `kda_layers` / `full_attn_layers`, num_experts,
num_experts_per_token, num_shared_experts, moe_renormalize, first_k_dense_replace, ...).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec

from .configuration_kimi_hybrid_vision import EXTRA_ATTRIBUTES_KEY, TRANSFORMERS_GENERIC_FIELDS, KimiHybridVisionConfig
from .parallel_kimi_hybrid import ep_plan_for, pp_plan_for, tp_plan_for


LAYER_TYPES = ("linear_attention", "full_attention")  # KDA, MLA
MLP_LAYER_TYPES = ("dense", "sparse")  # SwiGLU, MoE
ATTN_RESIDUALS = ("none", "block", "full")


def kimi_linear_layer_types(num_layers: int) -> list[str]:
    """Kimi Linear's 3:1 pattern: MLA at every 4th layer (1-based 4, 8, ...) and at the last one."""
    return [
        "full_attention" if (i + 1) % 4 == 0 or i == num_layers - 1 else "linear_attention" for i in range(num_layers)
    ]


_LINEAR_ATTN_CONFIG_KEYS = {
    "num_heads",
    "head_dim",
    "short_conv_kernel_size",
    "kda_layers",
    "full_attn_layers",
    "use_full_rank_gate",
    "gate_lower_bound",
}
_ACTIVATIONS = set(ACT2FN)

# Fields of Moonshot's config.json (Kimi Linear, Kimi K3) that describe a choice this model makes one way only:
# a value other than the one implemented is an architecture we do not run, never dropped silently.
_MOONSHOT_FIXED = {
    "moe_router_activation_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
    "moe_layer_freq": (1,),
    "num_nextn_predict_layers": (0,),
}
# plus the generic fields a text config.json of Moonshot or transformers carries: not architecture
_GENERIC_FIELDS = TRANSFORMERS_GENERIC_FIELDS | {
    "_attn_implementation_autoset",
    "_commit_hash",
    "_name_or_path",
    "ignore_index",
    "pretraining_tp",  # Llama-era field transformers' kimi_linear still writes (1: no effect)
    "quantization_config",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "use_grouped_topk",
}


_GENERATION_BOILERPLATE = {
    "bad_words_ids",
    "begin_suppress_tokens",
    "suppress_tokens",
    "diversity_penalty",
    "do_sample",
    "early_stopping",
    "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "length_penalty",
    "max_length",
    "min_length",
    "no_repeat_ngram_size",
    "num_beam_groups",
    "num_beams",
    "num_return_sequences",
    "output_scores",
    "remove_invalid_values",
    "repetition_penalty",
    "return_dict_in_generate",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
}


def _check_moonshot_fields(kwargs: dict, strict: bool, ours: frozenset = frozenset()) -> None:
    """Pops the Moonshot fields this model understands; ValueError for a value of one we implement differently.
    strict (a config in Moonshot's format: Kimi Linear's / K3's config.json): ValueError naming any other field that
    is not generic. Configs built in transformers' own way (keyword arguments; its tests add generic fields such as
    `layer_norm_eps` to every config) keep transformers' behaviour: extra fields become attributes."""
    for name, allowed in _MOONSHOT_FIXED.items():
        if name in kwargs and (value := kwargs.pop(name)) not in allowed:
            raise ValueError(f"{name} = {value!r} is not supported (this model implements {list(allowed)})")
    if kwargs.get("use_grouped_topk") is False and kwargs.get("n_group", kwargs.get("num_expert_group", 1)) > 1:
        raise ValueError("use_grouped_topk = False with num_expert_group > 1 is not supported")
    if kwargs.get("rope_scaling"):
        raise ValueError(f"rope_scaling = {kwargs['rope_scaling']!r}: this model's MLA uses no positional encoding")
    if strict:  # transformers 4.x wrote its generation defaults into Moonshot's config.json (max_length 20, ...):
        for name in _GENERATION_BOILERPLATE & set(kwargs):  # they would become this model's generation config
            kwargs.pop(name)
    unknown = sorted(k for k in kwargs if k not in _GENERIC_FIELDS | ours and not k.startswith("_"))
    if strict and unknown:
        raise ValueError(f"config fields this model does not implement: {unknown}")


def _ids(value) -> list:
    """A token-id field's ids (eos_token_id may be a list)."""
    return value if isinstance(value, list) else [value]


@strict
class KimiHybridTextConfig(PreTrainedConfig):
    r"""
    Hybrid decoder: each layer mixes tokens with Kimi Delta Attention ("linear_attention") or MLA
    ("full_attention", no positional encoding), then applies a SwiGLU ("dense") or an MoE ("sparse").

    Args (beyond the usual decoder ones):
        layer_types: per-layer mixer, default Kimi Linear's 3:1 pattern.
        mlp_layer_types: per-layer FFN, default dense for the first `first_k_dense_replace` layers.
        linear_num_heads, linear_head_dim, linear_conv_kernel_dim: the KDA layers.
        kv_lora_rank, q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA.
        num_experts, num_experts_per_tok, n_shared_experts, moe_intermediate_size, n_group, topk_group,
        routed_scaling_factor, norm_topk_prob: the DeepSeek-V3 style MoE (sigmoid router, noaux_tc).
        router_aux_loss_coef: weight of the load-balancing loss added to the loss when `output_router_logits`
            (the loss is returned as `aux_loss` either way). Default 0.0: Kimi Linear and Kimi K3 balance their
            experts without an auxiliary loss (`topk_method="noaux_tc"`: the router's correction bias, trained
            by `kimi_hf.optim.ExpertBiasCallback`); neither released config declares a coefficient, nor does
            transformers' kimi_linear, so TRL's SFTTrainer (which reads this field) optimises the released
            objective. Set it (DeepSeek-V3 used 1e-4 to 1e-3 for its sequence-wise loss) to add the loss.
        attn_residual: "none" (the residual sum), "block" (Block Attention Residuals: each sublayer's
            input is softmax attention over the embedding, the completed blocks and the current partial
            sum) or "full" (every sublayer its own block).
        attn_residual_block_size: sublayers per block (attention and MLP count separately); default:
            about 8 blocks. Must be 1 or None with "full". Kimi K3's `attn_res_block_size` counts decoder layers:
            S layers = 2 S sublayers here (the same blocks: K3 writes a block before the attention of layers
            l % S == 0, which is sublayer 2 l % 2 S == 0).
        attn_residual_query_init: "zero" (a uniform average at init, arXiv 2603.15031) or "normal" (K3:
            normal(0, initializer_range), as its `*_res_proj` weights are trained from).

    Kimi K3 options (off by default, the Kimi Linear model):
        hidden_act "situ" with activation_situ_beta / activation_situ_linear_beta: SiTU-GLU in every FFN,
            beta tanh(a / beta) sigmoid(a) * linear_beta tanh(up / linear_beta), fp32.
        kda_full_rank_output_gate: the KDA output gate is one full-rank g_proj [H K, hidden] (K3) instead of
            Kimi Linear's low-rank g_a_proj / g_b_proj.
        kda_gate_lower_bound: the lower bound of KDA's "safe gate" (kimi_hf.ops.kda_inputs.kda_gate; K3: -5.0)
            instead of Kimi Linear's unbounded gate.
        mla_use_output_gate: MLA output multiplied per channel by sigmoid(g_proj(x)) before o_proj (K3).
        mla_latent_norm_eps: eps of MLA's q_a_layernorm / kv_a_layernorm (1e-6 in Kimi Linear's and K3's code,
            which build them without an eps argument).
        routed_expert_hidden_size: Stable LatentMoE (K3): routed experts run in this latent width, between
            routed_expert_down_proj and routed_expert_up_proj; the router and the shared experts see the full
            hidden. latent_moe_use_norm: an RMSNorm (routed_expert_norm) of the weighted expert sum.
    Training:
        loss_chunk_size: None (default) computes the loss from the whole logits, as transformers does; a number of
            tokens makes a forward with `labels` compute the head and the cross-entropy that many tokens at a time,
            the logits never whole (kimi_hf.ops.chunked_cross_entropy: exact, the logits recomputed in the
            backward) and return `logits=None`. Forwards without labels, or with `logits_to_keep`, are unchanged.
            Kimi K3 at 8192 tokens (vocab 163840, bf16): the plain loss peaks at 15.0 GB a sequence beyond its
            inputs, 1024 tokens a chunk at 3.3 GB, 2.2 GB of which is the head's gradient that both hold
            (benchmarks/chunked_loss.py). A training setting, not an architecture field: K3's config (released
            field names) writes it only when set.
    Moonshot's config.json spells some of these differently (linear_attn_config.use_full_rank_gate /
    gate_lower_bound, attn_res_block_size in layers); both spellings are read. Fields of an architecture this
    class does not implement (MTP layers, another router activation, ...) raise a ValueError naming them.
    """

    model_type = "kimi_hybrid_text"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "num_local_experts": "num_experts",
        "n_routed_experts": "num_experts",
        "num_experts_per_token": "num_experts_per_tok",
        "num_shared_experts": "n_shared_experts",
        "moe_renormalize": "norm_topk_prob",
        "num_expert_group": "n_group",
        "model_max_length": "max_position_embeddings",
    }
    # The parallel plans (docs/parallelism.md, parallel_kimi_hybrid.py): TP_PLAN, EP_PLAN and PP_PLAN / ATTN_RES_PP_PLAN, read through
    # the properties base_model_tp_plan / base_model_pp_plan, which follow the instance's architecture.

    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_hidden_layers: int = 27
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    num_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.446
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0  # aux-loss-free balancing, as released (see the docstring)
    output_router_logits: bool = False
    linear_num_heads: int = 32
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = 163839
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163586
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    attn_residual: str = "none"
    attn_residual_block_size: int | None = None
    attn_residual_query_init: str = "zero"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    kda_full_rank_output_gate: bool = False
    kda_gate_lower_bound: float | None = None
    mla_use_output_gate: bool = False
    mla_latent_norm_eps: float = 1e-6
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    loss_chunk_size: int | None = None  # training: the chunked head + loss (see the docstring)

    def __post_init__(self, **kwargs):
        for alias, field in self.attribute_map.items():  # other spellings, applied before validation
            if alias in kwargs:
                setattr(self, field, kwargs.pop(alias))
        # Moonshot's original config.json keeps the KDA settings in a sub-dict, layers 1-based
        # Moonshot's format (Kimi Linear's / K3's config.json): checked strictly for fields we do not implement
        moonshot = "linear_attn_config" in kwargs or kwargs.get("model_type") == "kimi_linear"
        lac = kwargs.pop("linear_attn_config", None) or {}
        self.linear_num_heads = lac.get("num_heads", self.linear_num_heads)
        self.linear_head_dim = lac.get("head_dim", self.linear_head_dim)
        self.linear_conv_kernel_dim = lac.get("short_conv_kernel_size", self.linear_conv_kernel_dim)
        self.kda_full_rank_output_gate = lac.get("use_full_rank_gate", self.kda_full_rank_output_gate)
        self.kda_gate_lower_bound = lac.get("gate_lower_bound", self.kda_gate_lower_bound)
        unknown = sorted(set(lac) - _LINEAR_ATTN_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"linear_attn_config has fields this model does not implement: {unknown}")
        if (k3_block := kwargs.pop("attn_res_block_size", None)) is not None:  # K3 counts decoder layers
            if isinstance(k3_block, bool) or not isinstance(k3_block, int) or k3_block < 1:
                raise ValueError(f"attn_res_block_size must be a positive number of layers, got {k3_block!r}")
            self.attn_residual, self.attn_residual_block_size = "block", 2 * k3_block
            self.attn_residual_query_init = "normal"
        if self.layer_types is None:
            if "kda_layers" in lac or "full_attn_layers" in lac:
                types = [None] * self.num_hidden_layers
                for name, key in (("linear_attention", "kda_layers"), ("full_attention", "full_attn_layers")):
                    for layer in lac.get(key, []):
                        if not 1 <= layer <= self.num_hidden_layers:
                            raise ValueError(
                                f"linear_attn_config.{key} lists layer {layer}, outside 1..{self.num_hidden_layers}"
                            )
                        if types[layer - 1] is not None:
                            raise ValueError(
                                f"linear_attn_config: layer {layer} is in both kda_layers and full_attn_layers"
                            )
                        types[layer - 1] = name
                if None in types:
                    raise ValueError(
                        f"linear_attn_config leaves layers {[i + 1 for i, t in enumerate(types) if t is None]} without a type"
                    )
                self.layer_types = types
            else:
                self.layer_types = kimi_linear_layer_types(self.num_hidden_layers)
        k_dense = kwargs.pop("first_k_dense_replace", 1)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = ["dense" if i < k_dense else "sparse" for i in range(self.num_hidden_layers)]
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        kwargs.pop("head_dim", None)  # written by transformers' kimi_linear; derived here
        kwargs.pop("qk_head_dim", None)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        kwargs.pop("model_type", None)  # a Moonshot folder says "kimi_linear": the instance keeps the class's
        ours = frozenset(kwargs.pop(EXTRA_ATTRIBUTES_KEY, ()))  # extra attributes a K3 config's to_dict wrote
        _check_moonshot_fields(kwargs, strict=moonshot, ours=ours)
        self._validate()  # before the base class: a plain ValueError naming the field
        super().__post_init__(**kwargs)

    @property
    def base_model_tp_plan(self) -> dict[str, str]:
        """TP_PLAN without the rules for modules this architecture lacks (q_b_proj without q_lora_rank, KDA or MLA
        rules without such layers, ...), which transformers would otherwise warn about at every load. A property:
        it follows attributes changed after construction, and transformers never serializes it."""
        return tp_plan_for(self)

    @property
    def base_model_ep_plan(self) -> dict[str, str]:
        """EP_PLAN, with the scales of routed experts kept in MXFP4 (Kimi K3's experts_format="mxfp4")."""
        return ep_plan_for(self)

    @property
    def base_model_pp_plan(self) -> dict[str, tuple[list[str], list[str]]]:
        """PP_PLAN, or ATTN_RES_PP_PLAN with Attention Residuals (the layers pass the partial sum and the blocks)."""
        return pp_plan_for(self)

    def validate_architecture(self):
        """Part of `@strict` validation (e.g. after attributes were changed)."""
        self._validate()

    def _validate(self):
        """Every error names the field at fault."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "num_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
            "linear_num_heads",
            "linear_head_dim",
            "linear_conv_kernel_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim < 0:
            raise ValueError(f"qk_rope_head_dim must be >= 0, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be None or a positive integer, got {self.q_lora_rank}")
        if not self.mla_use_nope:
            raise ValueError(
                "mla_use_nope=False (rotary MLA) is not supported: Kimi Linear's MLA uses no positional encoding"
            )
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                f"({self.num_attention_heads}) for MLA"
            )
        for field, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = getattr(self, field)
            if len(types) != self.num_hidden_layers:
                raise ValueError(f"{field} has {len(types)} entries but num_hidden_layers is {self.num_hidden_layers}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{field} has unknown types {bad}; allowed: {list(allowed)}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) > num_experts ({self.num_experts})")
        if self.num_experts % self.n_group:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) > n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group "
                f"({self.topk_group}) groups"
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the vocabulary range: check_token_ids
            value = getattr(self, name)
            if any(i is not None and (isinstance(i, bool) or not isinstance(i, int) or i < 0) for i in _ids(value)):
                raise ValueError(
                    f"{name} must be a non-negative integer token id (or a list of them for eos), or None; got {value!r}"
                )
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.attn_residual not in ATTN_RESIDUALS:
            raise ValueError(f"attn_residual must be one of {list(ATTN_RESIDUALS)}, got {self.attn_residual!r}")
        bs = self.attn_residual_block_size
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int) or bs < 1):
            raise ValueError(f"attn_residual_block_size must be None or a positive integer, got {bs!r}")
        if self.attn_residual_query_init not in ("zero", "normal"):
            raise ValueError(
                f"attn_residual_query_init must be 'zero' or 'normal', got {self.attn_residual_query_init!r}"
            )
        if self.hidden_act == "situ":
            for name in ("activation_situ_beta", "activation_situ_linear_beta"):
                value = getattr(self, name)
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                    raise ValueError(f"{name} must be None or a non-negative number, got {value!r}")
        elif self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be 'situ' or one of transformers' activations, got {self.hidden_act!r}")
        lb = self.kda_gate_lower_bound
        if lb is not None and (isinstance(lb, bool) or not isinstance(lb, (int, float)) or not lb < 0):
            raise ValueError(f"kda_gate_lower_bound (linear_attn_config.gate_lower_bound) must be < 0, got {lb!r}")
        if self.mla_latent_norm_eps <= 0:
            raise ValueError(f"mla_latent_norm_eps must be > 0, got {self.mla_latent_norm_eps}")
        latent = self.routed_expert_hidden_size
        if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int) or latent < 1):
            raise ValueError(f"routed_expert_hidden_size must be None or a positive integer, got {latent!r}")
        if self.latent_moe_use_norm and latent is None:
            raise ValueError("latent_moe_use_norm needs routed_expert_hidden_size (the latent width it normalises)")
        chunk = self.loss_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"loss_chunk_size must be None or a positive number of tokens, got {chunk!r}")
        if self.attn_residual == "full" and bs not in (None, 1):
            raise ValueError(
                f"attn_residual='full' means one sublayer per block: attn_residual_block_size must be "
                f"None or 1, got {bs}"
            )

    def check_token_ids(self) -> None:
        """ValueError naming the field when pad / bos / eos ids are not ids of the vocabulary. Run by the model
        before it builds its embedding, not by the config: transformers builds configs field by field (its
        common tests set the ids after construction), and the defaults are ids of Kimi's 163840 tokens."""
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if any(i is not None and i >= self.vocab_size for i in _ids(value)):
                default = (
                    " (the default, an id of Kimi's tokenizer)"
                    if value == type(self).__dataclass_fields__[name].default
                    else ""
                )
                raise ValueError(
                    f"{name} = {value!r}{default} is not a token id of the vocabulary (vocab_size "
                    f"{self.vocab_size}): pass your tokenizer's {name}, or None"
                )

    def resolved_attn_residual_block_size(self) -> int | None:
        """Sublayers per depth-attention block, or None for the plain residual."""
        if self.attn_residual == "none":
            return None
        if self.attn_residual == "full":
            return 1
        return self.attn_residual_block_size or max(1, -(-2 * self.num_hidden_layers // 8))  # about 8 blocks


@strict
class KimiHybridConfig(PreTrainedConfig):
    r"""
    The early-fusion multimodal model: a hybrid KDA/MLA text decoder (`text_config`) and a MoonViT
    vision tower (`vision_config`) whose merged patches are projected into the text stream at the
    `image_token_id` placeholders (one per merged patch).

    Args:
        text_config: KimiHybridTextConfig or its dict; vision_config: KimiHybridVisionConfig or its dict.
        image_token_id: the placeholder id (`<|media_pad|>`); media_begin_token_id / media_end_token_id:
            the markers around an image in the chat markup (optional).
        projection_layer_norm_eps: eps of the projector's per-patch LayerNorm.
    """

    model_type = "kimi_hybrid"
    # transformers' FSDP2 at load (DistributedConfig(fsdp_size=...)): one unit per decoder layer comes from the text
    # model's config (language_model.layers.*); the multimodal class itself has no embed_tokens / layers / norm
    base_model_fsdp_plan = {}
    sub_configs_defaults = {
        "text_config": SubConfigSpec(config_class=KimiHybridTextConfig),
        "vision_config": SubConfigSpec(config_class=KimiHybridVisionConfig),
    }

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    image_token_id: int = 163605
    media_begin_token_id: int | None = None
    media_end_token_id: int | None = None
    projection_layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate()

    def validate_architecture(self):
        self._validate()

    def _validate(self):
        vocab = self.text_config.vocab_size
        for name in ("image_token_id", "media_begin_token_id", "media_end_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < vocab):
                raise ValueError(f"{name} must be a token id in [0, text_config.vocab_size = {vocab}), got {value!r}")

    def get_text_config(self, *args, **kwargs):
        return self.text_config


__all__ = [
    "KimiHybridTextConfig",
    "KimiHybridVisionConfig",
    "KimiHybridConfig",
    "kimi_linear_layer_types",
    "LAYER_TYPES",
    "MLP_LAYER_TYPES",
]
