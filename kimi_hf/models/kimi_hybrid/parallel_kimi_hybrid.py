"""The parallel plans of the hybrid decoder (Kimi Linear and Kimi K3): tensor, expert and pipeline parallelism as
transformers reads them from the config (`base_model_tp_plan` / `_ep_plan` / `_pp_plan`), the check of a
layout the model cannot run (`check_parallel_layout`), and the check of PEFT LoRA layers put into a tensor-parallel
model (`TensorParallelLoraCheck`). See docs/parallelism.md."""

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
_MLA_ONLY = ("q_b_proj", "kv_a_output", "kv_b_proj")

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
    # MLA: per-head queries and key/value expansion; the latent projection stays replicated. mla_kv_a_proj sums
    # the gradient of the rope key, which every head reads, on kv_a_output (an identity on the projection's
    # output): there it also sums what a LoRA adapter of kv_a_proj_with_mqa adds (PEFT adds it after the
    # projection's own forward, so a rule on the projection would leave the adapter's rope gradient partial)
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_output": "mla_kv_a_proj",
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


# PEFT LoRA under tensor parallelism. PEFT (>= 0.21 with transformers' DTensor TP) reads each target's rule from
# model.tp_plan (it records it as `_hf_tp_plan` on the base layer) and shards the adapter to follow "colwise" (B by
# output rows) and "rowwise" (A by input columns) layers; any other style gets plain adapters beside a sharded or
# hooked base, which compute or train something else. Our plan keeps LoRA targets to colwise, rowwise and
# replicated (kv_a_output above), and the modules holding them check each LoRA layer as PEFT puts it in place.
LORA_TP_STYLES = ("colwise", "rowwise")


def _tp_sharded(weight) -> bool:
    """weight is a DTensor on a mesh with a "tp" dimension of more than one rank (FSDP2's meshes: "fsdp" or
    unnamed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    if not isinstance(weight, DTensor):
        return False
    names = weight.device_mesh.mesh_dim_names or ()
    return "tp" in names and weight.device_mesh.size(names.index("tp")) > 1


def check_lora_layer(parent, name: str, layer) -> None:
    """Checks (and for "rowwise", completes) a PEFT LoRA layer that replaces parent.<name> in a tensor-parallel
    model: PEFT's `_replace_module` is a setattr on the parent, after the layer's adapters exist and before PEFT
    shards them, which is when this runs (`TensorParallelLoraCheck`). Raises ValueError for a base layer whose TP
    style PEFT's adapters do not follow. Without tensor parallelism (no style recorded, no TP-sharded weight) it
    returns at once.

    "rowwise": PEFT builds A as nn.Linear(local input width, r) and shards its weight as the base's (Shard(1) of
    the full [r, in]), but transformers' rowwise style reads the input's full width from the module's
    `in_features`: A's must be the base's, else the first forward with gradients fails on a shape."""
    base = layer.get_base_layer()
    style = getattr(base, "_hf_tp_plan", None)
    if style is None and not _tp_sharded(getattr(base, "weight", None)):
        return  # replicated (or no tensor parallelism): plain adapters are right
    if style == "colwise":
        return
    if style == "rowwise":
        for lora_a in layer.lora_A.values():
            lora_a.in_features = base.in_features
        return
    layer_idx = getattr(parent, "layer_idx", None)
    where = f"{type(parent).__name__}.{name}" + (f" (layer {layer_idx})" if layer_idx is not None else "")
    raise ValueError(
        f"PEFT LoRA on {where} under tensor parallelism: its TP style is {style or 'unknown to PEFT'!r}, and PEFT "
        f"fits adapters to {' / '.join(map(repr, LORA_TP_STYLES))} layers only (this one would get a plain adapter "
        f"that the layer's sharding and TP hooks miss: wrong outputs or gradients). Leave {name!r} out of "
        "target_modules (kimi_hf.lora_target_modules(config) lists targets that work under the default TP plan), "
        "give it a colwise / rowwise rule or none (DistributedConfig(tp_plan=...)), or shard the model without "
        "TP: FSDP (DistributedConfig(fsdp_size=N)) or expert parallelism alone "
        "(DistributedConfig(tp_size=N, ep_size=N, tp_plan={}))"
    )


class TensorParallelLoraCheck:
    """Mixin of the modules whose children are LoRA targets (the mixers, the MLPs, the MoE): runs
    `check_lora_layer` when PEFT (get_peft_model, PeftModel.from_pretrained, model.add_adapter) puts a LoRA layer in
    place of a child, so that a target PEFT cannot shard is refused then, naming it, rather than training wrong.
    A setattr hook, not a forward hook: it costs nothing in the forward, and runs at the earliest point there is."""

    def __setattr__(self, name, value):
        if hasattr(value, "base_layer") and hasattr(value, "lora_A"):  # a PEFT LoRA layer (peft.tuners.lora)
            check_lora_layer(self, name, value)
        super().__setattr__(name, value)


__all__ = [
    "ATTN_RES_PP_ERROR",
    "ATTN_RES_PP_PLAN",
    "EP_PLAN",
    "LORA_TP_STYLES",
    "PP_PLAN",
    "TP_PLAN",
    "TensorParallelLoraCheck",
    "check_lora_layer",
    "check_parallel_layout",
    "pp_plan_for",
    "tp_plan_for",
]
