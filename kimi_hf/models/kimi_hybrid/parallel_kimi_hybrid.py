"""The parallel plans of the hybrid decoder (Kimi Linear and Kimi K3): tensor, expert and pipeline parallelism as
transformers reads them from the config (`base_model_tp_plan` / `_ep_plan` / `_pp_plan`), and the check of a
layout the model cannot run (`check_parallel_layout`). See docs/parallelism.md."""

from __future__ import annotations


# self_attn children that only one mixer kind has (both kinds share q_proj and o_proj)
_KDA_ONLY = (
    "k_proj",
    "v_proj",
    "q_conv1d",
    "k_conv1d",
    "v_conv1d",
    "f_b_proj",
    "g_b_proj",
    "b_proj",
    "A_log",
    "dt_bias",
    "o_norm",
)
_MLA_ONLY = ("q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")

# Tensor parallelism (docs/parallelism.md). KDA and MLA layers are both `self_attn`, so one rule can cover a
# projection of either kind. Both shard by head: colwise projections keep this rank's heads (rows), the op runs
# on local heads (views use -1 heads), o_proj is rowwise (the one all-reduce of the mixer). Replicated: KDA's
# f_a_proj / g_a_proj (the low-rank gate inputs, shared by heads), MLA's q_a_proj / q_a_layernorm /
# kv_a_layernorm (the latents, shared by heads), the router, the norms and the depth attention (AttnRes).
TP_PLAN = {
    # KDA: q/k/v and their depthwise short convs (channels = heads x head_dim), the per-head decay (A_log),
    # gate bias (dt_bias), beta (b_proj) and low-rank gate outputs (f_b_proj, g_b_proj)
    "layers.*.self_attn.q_proj": "colwise",  # also MLA's q_proj (q_lora_rank None)
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    # a param-only rule shards the conv weight [D, 1, W] on its channels (embedding_rowwise: Shard(0), no
    # forward hook); local_params runs the conv's forward on its local weight
    "layers.*.self_attn.q_conv1d.weight": "embedding_rowwise",
    "layers.*.self_attn.k_conv1d.weight": "embedding_rowwise",
    "layers.*.self_attn.v_conv1d.weight": "embedding_rowwise",
    "layers.*.self_attn.q_conv1d": "local_params",
    "layers.*.self_attn.k_conv1d": "local_params",
    "layers.*.self_attn.v_conv1d": "local_params",
    "layers.*.self_attn.f_b_proj": "colwise",
    "layers.*.self_attn.g_b_proj": "colwise",
    "layers.*.self_attn.b_proj": "colwise",
    "layers.*.self_attn.A_log": "colwise",  # bare 1-D parameters: Shard(0), read locally (local_params below)
    "layers.*.self_attn.dt_bias": "colwise",
    "layers.*.self_attn.o_norm": "replicated_with_grad_allreduce",  # one weight for all heads: partial grads
    # MLA: per-head queries and key/value expansion; the latent projection stays replicated (mla_kv_a_proj
    # sums the gradient of the rope key, which every head reads)
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.self_attn.kv_b_proj": "colwise",
    # Kimi K3's output gates, per head channel: KDA's full-rank g_proj [H K, hidden], MLA's g_proj [H v, hidden]
    "layers.*.self_attn.g_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",  # KDA and MLA
    "layers.*.self_attn": "local_params",
    # MoE (as transformers' kimi_linear / deepseek_v3): every expert's intermediate dim split over the ranks
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
    "layers.*.mlp.shared_experts.gate_proj": "colwise",
    "layers.*.mlp.shared_experts.up_proj": "colwise",
    "layers.*.mlp.shared_experts.down_proj": "rowwise",
    # dense SwiGLU layers
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# Expert parallelism (`DistributedConfig(tp_size=N, ep_size=N)`): whole experts per rank, dispatched by
# transformers' EP implementations; takes precedence over the experts' TP rules.
EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}
# Routed experts kept in MXFP4 (KimiHybridMxfp4Experts): the packed bytes are named as the dense weights and split
# the same way (rows of gate_up_proj, inputs of down_proj); their E8M0 scales, one per 32 inputs, go with them
MXFP4_SCALES = {"layers.*.mlp.experts.gate_up_proj": "_scale", "layers.*.mlp.experts.down_proj": "_scale"}


def _with_scales(plan: dict[str, str], config) -> dict[str, str]:
    """plan plus, for resident MXFP4 experts, each packed tensor's scale under the packed tensor's rule."""
    if getattr(config, "experts_format", "dense") != "mxfp4":
        return plan
    out = dict(plan)
    for key, suffix in MXFP4_SCALES.items():
        if key in plan:
            out[key + suffix] = plan[key]
    return out


def ep_plan_for(config) -> dict[str, str]:
    """EP_PLAN (plus the MXFP4 scales of resident experts)."""
    return _with_scales(EP_PLAN, config)


# What each stage passes on. With Attention Residuals (attn_residual != "none") a layer maps the partial sum
# and the completed depth blocks to the same pair, and the final depth attention precedes the norm: the
# instance's plan then is ATTN_RES_PP_PLAN (transformers' naive pipeline, which sends one tensor between stages,
# cannot run it: see docs/parallelism.md).
PP_PLAN = {
    "embed_tokens": (["input_ids"], ["inputs_embeds"]),
    "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
    "norm": (["hidden_states"], ["hidden_states"]),
}
ATTN_RES_PP_PLAN = {
    "embed_tokens": (["input_ids"], ["inputs_embeds"]),
    "layers": (["hidden_states", "depth_blocks", "attention_mask"], ["hidden_states", "depth_blocks"]),
    "final_res": (["depth_blocks", "hidden_states"], ["hidden_states"]),
    "norm": (["hidden_states"], ["hidden_states"]),
}

ATTN_RES_PP_ERROR = (
    "Attention Residuals under pipeline parallelism: transformers' pipeline passes one tensor "
    "between stages, but these layers pass the partial sum and the completed depth blocks (see "
    "config.base_model_pp_plan); use tensor / expert parallelism, or attn_residual='none'"
)


def tp_plan_for(config) -> dict[str, str]:
    """TP_PLAN without the rules for modules this architecture (a KimiHybridTextConfig) lacks: q_b_proj without
    q_lora_rank, KDA or MLA rules without such layers, ... (transformers would warn about each at every load)."""
    absent = set()
    if config.q_lora_rank is None:
        absent.add("q_b_proj")
    elif "linear_attention" not in config.layer_types:
        absent.add("q_proj")
    if "linear_attention" not in config.layer_types:
        absent |= set(_KDA_ONLY)
    if "full_attention" not in config.layer_types:
        absent |= set(_MLA_ONLY)
    if "sparse" not in config.mlp_layer_types:
        absent |= {"experts", "shared_experts"}
    if "dense" not in config.mlp_layer_types:
        absent |= {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    if not config.n_shared_experts:
        absent.add("shared_experts")
    kda = "linear_attention" in config.layer_types
    if not (kda and config.kda_full_rank_output_gate) and not (
        "full_attention" in config.layer_types and config.mla_use_output_gate
    ):
        absent.add("g_proj")
    if kda and config.kda_full_rank_output_gate:
        absent.add("g_b_proj")
    plan = {k: v for k, v in TP_PLAN.items() if not any(f".{name}." in f".{k}." for name in absent)}
    return _with_scales(plan, config)


def pp_plan_for(config) -> dict[str, tuple[list[str], list[str]]]:
    """PP_PLAN, or ATTN_RES_PP_PLAN with Attention Residuals (the layers pass the partial sum and the blocks)."""
    return dict(PP_PLAN if config.attn_residual == "none" else ATTN_RES_PP_PLAN)


def check_parallel_layout(text_config, tp_plan: dict[str, str], distributed_config, multimodal: bool = False) -> None:
    """Raises ValueError for a layout the model (text_config: a KimiHybridTextConfig) cannot run: pipeline parallelism with Attention Residuals or of a
    multimodal model, or a per-head TP plan whose head counts tp_size does not divide (a rank would hold part of a
    head)."""
    if distributed_config.pp_size > 1 and multimodal:
        raise ValueError(
            "pipeline parallelism (pp_size > 1) of the multimodal model: transformers' pipeline splits "
            "base_model.layers, and this model's decoder is model.language_model behind the vision tower; use tensor "
            "/ expert parallelism, or load the text model (AutoModelForCausalLM on a text-only checkpoint)"
        )
    if distributed_config.pp_size > 1 and text_config.attn_residual != "none":
        raise ValueError(ATTN_RES_PP_ERROR)
    tp = distributed_config.tp_size
    override = distributed_config.tp_plan
    if tp <= 1 or override == {}:
        return
    plan = {**tp_plan, **(override if isinstance(override, dict) else {})}
    sharded = {key.rsplit(".", 1)[-1] for key, style in plan.items() if "self_attn." in key and style == "colwise"}
    for proj, field, layer_type in (
        ("k_proj", "linear_num_heads", "linear_attention"),
        ("kv_b_proj", "num_attention_heads", "full_attention"),
    ):
        heads = getattr(text_config, field)
        if proj in sharded and layer_type in text_config.layer_types and heads % tp:
            raise ValueError(
                f"{field} ({heads}) must be divisible by tp_size ({tp}): the TP plan shards "
                f"{layer_type} layers by head (or pass DistributedConfig(tp_plan=...) replicating them)"
            )


__all__ = [
    "ATTN_RES_PP_ERROR",
    "ATTN_RES_PP_PLAN",
    "EP_PLAN",
    "PP_PLAN",
    "TP_PLAN",
    "check_parallel_layout",
    "pp_plan_for",
    "tp_plan_for",
]
