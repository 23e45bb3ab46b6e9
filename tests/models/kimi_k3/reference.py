"""An independent float64 reference forward of Kimi K3, written from the K3 fact sheet's maths (§3).

Independent of ``kimi_hf`` (torch only). Clarity over speed: plain loops per token / head / expert, tiny shapes.
Every function works on ONE sequence ``[T, hidden]`` (batch rows are independent; no padding / attention mask).

Inputs are the *logical* tensors by official name, as :func:`release_format.write_k3_checkpoint` returns them
(routed experts dequantised under ``experts.{E}.w{1,2,3}.weight``, A_log at its stored [head_dim] shape); they are
upcast to float64 here.

Public API
----------
``k3_reference_logits(config, tensors, input_ids, pixel_values=None, image_grid_thw=None) -> [B, T, vocab] fp64``
``k3_reference_image_features(config, tensors, pixel_values, grid_thw) -> [sum(t·h·w/4), text_hidden] fp64``
``k3_reference_greedy(config, tensors, input_ids, max_new_tokens, ...) -> [B, T + max_new_tokens] int64``
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch


Tensor = torch.Tensor

# K3: q_a_layernorm / kv_a_layernorm are built without an eps argument, so they get KimiRMSNorm's default 1e-6
# (every other text norm uses rms_norm_eps) (§3.3, §5.12).
MLA_LATENT_NORM_EPS = 1e-6
# FLA l2norm inside the KDA kernel (use_qk_l2norm_in_kernel=True) (§3.2).
KDA_L2NORM_EPS = 1e-6
# Vision nn.RMSNorm(dim) has no eps, so PyTorch uses torch.finfo(runtime dtype).eps (§5.21). The fp64 reference uses
# the fp32 value, which matches the fp32 runs we compare against (pass 2**-7 to mimic a bf16 run).
VISION_NORM_EPS_FP32 = float(torch.finfo(torch.float32).eps)  # 1.1920929e-07


class _Weights:
    """Read-only view of the logical tensors as float64 (``w["name"]``, ``w.get("name")``)."""

    def __init__(self, tensors: Mapping[str, Tensor]):
        self._tensors = tensors

    def __getitem__(self, name: str) -> Tensor:
        return self._tensors[name].to(torch.float64)

    def get(self, name: str) -> Tensor | None:
        return self[name] if name in self._tensors else None


# --------------------------------------------------------------------------------------------------------------
# Small building blocks
# --------------------------------------------------------------------------------------------------------------


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x Wᵀ``; x [..., in], weight [out, in] -> [..., out]. No bias anywhere in K3."""
    return x @ weight.transpose(0, 1)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """KimiRMSNorm / nn.RMSNorm over the last dim: ``w ⊙ x / sqrt(mean(x²) + eps)`` (cast order irrelevant in fp64)."""
    y = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def sigmoid(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: Tensor) -> Tensor:
    return x * sigmoid(x)


def softplus(x: Tensor) -> Tensor:
    """``log(1 + e^x)`` (computed stably)."""
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-torch.abs(x)))


def gelu_exact(x: Tensor) -> Tensor:
    """``nn.GELU()``: ``x/2 · (1 + erf(x/√2))`` (the projector, §3.9)."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x: Tensor) -> Tensor:
    """``PytorchGELUTanh``: ``x/2 · (1 + tanh(√(2/π)(x + 0.044715 x³)))`` (the ViT MLP, §3.9)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    e = torch.exp(x - x.max(dim=dim, keepdim=True).values)
    return e / e.sum(dim=dim, keepdim=True)


def situ(a: Tensor, beta) -> Tensor:
    """SiTU (§3.4): ``β · tanh(a/β) · σ(a)`` with ``β = beta or 1.0`` (so 0 / None silently become 1.0, §5.24)."""
    beta = beta or 1.0
    return beta * torch.tanh(a / beta) * sigmoid(a)


def situ_glu(gate: Tensor, up: Tensor, beta, linear_beta) -> Tensor:
    """``SituAndMul`` (§3.4): ``SiTU(gate) ⊙ up'`` with ``up' = β_l · tanh(up/β_l)`` only when β_l is not None."""
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return situ(gate, beta) * up


def glu_activation(tc: dict, gate: Tensor, up: Tensor) -> Tensor:
    """The FFN activation named by ``hidden_act``: K3 "situ" (SiTU-GLU); Kimi-Linear "silu" (SwiGLU)."""
    if tc["hidden_act"] == "situ":
        return situ_glu(gate, up, tc.get("activation_situ_beta"), tc.get("activation_situ_linear_beta"))
    if tc["hidden_act"] == "silu":
        return silu(gate) * up
    raise ValueError(f"unsupported hidden_act {tc['hidden_act']!r}")


def glu_mlp(tc: dict, x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor) -> Tensor:
    """``down(act(gate(x), up(x)))``; x [T, hidden] -> [T, hidden]."""
    return linear(glu_activation(tc, linear(x, gate_w), linear(x, up_w)), down_w)


# --------------------------------------------------------------------------------------------------------------
# KDA (§3.2)
# --------------------------------------------------------------------------------------------------------------


def causal_short_conv(x: Tensor, weight: Tensor) -> Tensor:
    """FLA ShortConvolution without activation: causal depthwise conv1d, left zero padding, no bias.

    x [T, D], weight [D, 1, W] -> [T, D]; ``y_t[c] = Σ_j w[c, 0, j] · x_{t-(W-1)+j}[c]`` (w[..., W-1] multiplies
    the current token).
    """
    T, D = x.shape
    W = weight.shape[-1]
    y = torch.zeros_like(x)
    for t in range(T):
        for j in range(W):
            src = t - (W - 1) + j
            if src >= 0:
                y[t] += weight[:, 0, j] * x[src]
    return y


def kda_safe_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """K3 safe gate (``gate_lower_bound`` set): ``g = λ · σ(exp(A_log[h]) · (f + dt_bias))`` ∈ (λ, 0).

    f [T, H, K], A_log [H] (already narrowed), dt_bias [H, K] -> log-decay g [T, H, K]. Order (§3.2): add
    dt_bias first, multiply by the per-head exp(A_log), then sigmoid, then λ.
    """
    return lower_bound * sigmoid(torch.exp(A_log)[None, :, None] * (f + dt_bias[None]))


def kda_softplus_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tensor:
    """Kimi-Linear gate (no lower bound): ``g = -exp(A_log[h]) · softplus(f + dt_bias)``; shapes as kda_safe_gate."""
    return -torch.exp(A_log)[None, :, None] * softplus(f + dt_bias[None])


def l2_normalize(x: Tensor, eps: float = KDA_L2NORM_EPS) -> Tensor:
    """``x / sqrt(‖x‖² + eps)`` over the last dim."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The KDA recurrence, token by token and head by head (§3.2 step 6).

    q, k [T, H, K] (q already scaled by K^-1/2), v [T, H, V], g [T, H, K] (log-decay per key channel),
    beta [T, H], state [H, K, V] (default 0) -> (o [T, H, V], final state [H, K, V]).
    ``S' = Diag(exp(g_t)) S``; ``u = β (v − S'ᵀ k)``; ``S = S' + k uᵀ``; ``o = Sᵀ q``.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(H, K, V, dtype=q.dtype) if state is None else state.clone()
    o = torch.zeros(T, H, V, dtype=q.dtype)
    for t in range(T):
        for h in range(H):
            s_decayed = torch.exp(g[t, h])[:, None] * S[h]  # row d (a key channel) scaled by exp(g_d)
            u = beta[t, h] * (v[t, h] - s_decayed.transpose(0, 1) @ k[t, h])
            S[h] = s_decayed + torch.outer(k[t, h], u)
            o[t, h] = S[h].transpose(0, 1) @ q[t, h]
    return o, S


def kda_attention(tc: dict, w: _Weights, p: str, x: Tensor) -> Tensor:
    """A KDA layer (``KimiDeltaAttention``); x [T, hidden] (after input_layernorm) -> [T, hidden]. p = '...self_attn.'."""
    lac = tc["linear_attn_config"]
    H, K = lac["num_heads"], lac["head_dim"]
    T = x.shape[0]

    def conv_branch(name: str) -> Tensor:  # SiLU(Conv(x Wᵀ)), [T, H, K]
        return silu(causal_short_conv(linear(x, w[f"{p}{name}_proj.weight"]), w[f"{p}{name}_conv1d.weight"])).view(
            T, H, K
        )

    q, k, v = conv_branch("q"), conv_branch("k"), conv_branch("v")
    q = l2_normalize(q) * K**-0.5
    k = l2_normalize(k)

    f = linear(linear(x, w[f"{p}f_a_proj.weight"]), w[f"{p}f_b_proj.weight"]).view(T, H, K)  # low-rank decay gate
    A_log = w[f"{p}A_log"][:H]  # K3 release: A_log stored [head_dim], only the first num_heads entries are used
    dt_bias = w[f"{p}dt_bias"].view(H, K)  # per channel h*K + d
    if lac.get("gate_lower_bound") is not None:
        g = kda_safe_gate(f, A_log, dt_bias, lac["gate_lower_bound"])
    else:
        g = kda_softplus_gate(f, A_log, dt_bias)
    beta = sigmoid(linear(x, w[f"{p}b_proj.weight"]))  # [T, H]

    o, _ = gated_delta_rule(q, k, v, g, beta)

    if lac["use_full_rank_gate"]:
        gate = linear(x, w[f"{p}g_proj.weight"])  # K3: full-rank output gate
    else:
        gate = linear(linear(x, w[f"{p}g_a_proj.weight"]), w[f"{p}g_b_proj.weight"])
    gate = gate.view(T, H, K)
    # FusedRMSNormGated(head_dim, rms_norm_eps, 'sigmoid'): per-head norm, one [head_dim] weight shared by heads
    o = rms_norm(o, w[f"{p}o_norm.weight"], tc["rms_norm_eps"]) * sigmoid(gate)
    return linear(o.reshape(T, H * K), w[f"{p}o_proj.weight"])


# --------------------------------------------------------------------------------------------------------------
# MLA, NoPE (§3.3)
# --------------------------------------------------------------------------------------------------------------


def mla_attention(tc: dict, w: _Weights, p: str, x: Tensor) -> Tensor:
    """An MLA layer (``KimiMLAAttention``, no rotary); x [T, hidden] (after input_layernorm) -> [T, hidden]."""
    assert tc["mla_use_nope"], "the HF code asserts mla_use_nope"
    H = tc["num_attention_heads"]
    nope, rope, v_dim, kv_rank = tc["qk_nope_head_dim"], tc["qk_rope_head_dim"], tc["v_head_dim"], tc["kv_lora_rank"]
    T = x.shape[0]

    if tc["q_lora_rank"] is None:
        q = linear(x, w[f"{p}q_proj.weight"])
    else:
        c_q = rms_norm(linear(x, w[f"{p}q_a_proj.weight"]), w[f"{p}q_a_layernorm.weight"], MLA_LATENT_NORM_EPS)
        q = linear(c_q, w[f"{p}q_b_proj.weight"])
    q = q.view(T, H, nope + rope)  # per head [q_nope | q_rope], the rope part left unrotated

    kv_a = linear(x, w[f"{p}kv_a_proj_with_mqa.weight"])  # [latent | k_rope]
    c_kv, k_rope = kv_a[:, :kv_rank], kv_a[:, kv_rank:]
    kv = linear(rms_norm(c_kv, w[f"{p}kv_a_layernorm.weight"], MLA_LATENT_NORM_EPS), w[f"{p}kv_b_proj.weight"])
    kv = kv.view(T, H, nope + v_dim)  # per head [k_nope | v]
    k_nope, v = kv[..., :nope], kv[..., nope:]

    scale = (nope + rope) ** -0.5
    out = torch.zeros(T, H, v_dim, dtype=x.dtype)
    for h in range(H):
        k_h = torch.cat([k_nope[:, h], k_rope], dim=-1)  # k_rope shared by all heads, never normalised
        for t in range(T):
            scores = (k_h[: t + 1] @ q[t, h]) * scale  # causal: keys 0..t
            out[t, h] = softmax(scores) @ v[: t + 1, h]
    out = out.reshape(T, H * v_dim)
    if tc["mla_use_output_gate"]:
        out = out * sigmoid(linear(x, w[f"{p}g_proj.weight"]))  # per channel, not per head
    return linear(out, w[f"{p}o_proj.weight"])


# --------------------------------------------------------------------------------------------------------------
# Router + Stable LatentMoE (§3.5)
# --------------------------------------------------------------------------------------------------------------


def moe_route(tc: dict, x: Tensor, gate_w: Tensor, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """KimiMoEGate on the full hidden; x [T, hidden] -> (expert ids [T, k] int64, weights [T, k]).

    ``s = σ(x Wᵀ)``; select top-k of ``s + bias`` (bias for selection only); weights = ``s`` at the selection,
    renormalised (``/ (Σ + 1e-20)``, when k > 1 and moe_renormalize) and times routed_scaling_factor.
    """
    assert tc["moe_router_activation_func"] == "sigmoid", "only the K3 sigmoid router is implemented"
    # num_expert_group = 1 means no group masking; grouped selection is not implemented here.
    assert tc.get("num_expert_group", 1) == 1 or tc.get("topk_group") == tc.get("num_expert_group")
    k = tc["num_experts_per_token"]
    scores = sigmoid(linear(x, gate_w))  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias
    ids = torch.topk(choice, k, dim=-1).indices
    weights = torch.gather(scores, 1, ids)
    if k > 1 and tc["moe_renormalize"]:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * tc["routed_scaling_factor"]


def sparse_moe(tc: dict, w: _Weights, p: str, x: Tensor) -> Tensor:
    """KimiSparseMoeBlock (latent MoE + shared experts); x [T, hidden] (after post_attention_layernorm) -> [T, hidden]."""
    ids, weights = moe_route(tc, x, w[f"{p}gate.weight"], w.get(f"{p}gate.e_score_correction_bias"))
    latent = tc["routed_expert_hidden_size"] is not None
    z = linear(x, w[f"{p}routed_expert_down_proj.weight"]) if latent else x  # [T, latent]

    routed = torch.zeros_like(z)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            e_p = f"{p}experts.{e}."  # w1 = gate, w3 = up, w2 = down
            y = glu_mlp(tc, z[t : t + 1], w[f"{e_p}w1.weight"], w[f"{e_p}w3.weight"], w[f"{e_p}w2.weight"])
            routed[t] += weights[t, slot] * y[0]

    if latent:
        if tc["latent_moe_use_norm"]:  # one RMSNorm of the weighted sum, in latent space
            routed = rms_norm(routed, w[f"{p}routed_expert_norm.weight"], tc["rms_norm_eps"])
        routed = linear(routed, w[f"{p}routed_expert_up_proj.weight"])
    if tc["num_shared_experts"]:  # ONE MLP of width moe_intermediate_size * num_shared_experts, on the full x
        s_p = f"{p}shared_experts."
        routed = routed + glu_mlp(
            tc, x, w[f"{s_p}gate_proj.weight"], w[f"{s_p}up_proj.weight"], w[f"{s_p}down_proj.weight"]
        )
    return routed


# --------------------------------------------------------------------------------------------------------------
# Block Attention Residuals (§3.6)
# --------------------------------------------------------------------------------------------------------------


def attn_res_mix(partial: Tensor, blocks: list[Tensor], norm_w: Tensor, proj_w: Tensor, eps: float) -> Tensor:
    """``_apply_attn_res(P, B)``: softmax-weighted mix over the raw sources ``[*B, P]``, per token.

    partial [T, D], blocks: n tensors [T, D], norm_w [D], proj_w [1, D] -> [T, D].
    ``score_i = Σ_d V_i,d / sqrt(mean_d V_i² + eps) · norm_w_d · proj_w_d``; ``α = softmax_i(score)`` (no
    temperature); ``out = Σ_i α_i V_i`` (the raw, un-normalised sources).
    """
    sources = [*blocks, partial]
    fold = norm_w * proj_w.reshape(-1)
    out = torch.zeros_like(partial)
    for t in range(partial.shape[0]):
        scores = torch.stack([(rms_norm(src[t], None, eps) * fold).sum() for src in sources])
        alpha = softmax(scores)
        for i, src in enumerate(sources):
            out[t] += alpha[i] * src[t]
    return out


SubLayer = Callable[[Tensor], Tensor]
Fold = tuple[Tensor, Tensor]


def block_attn_res_stack(
    embeddings: Tensor,
    layers: list[tuple[SubLayer, SubLayer, Fold, Fold]],
    output_fold: Fold,
    block_size: int,
    eps: float,
) -> Tensor:
    """The K3 AttnRes state machine over the decoder layers; returns the output mix (BEFORE the final norm).

    embeddings [T, D]; each layer is ``(attn, ffn, attn_fold, mlp_fold)`` where ``attn``/``ffn`` include their own
    input RMSNorm and a fold is ``(norm.weight [D], proj.weight [1, D])``. Per layer l with incoming partial P_in:
    1. ``h = Mix(P_in, B; attn_fold)`` if B is non-empty, else ``h = P_in``;
    2. if ``l % block_size == 0``: push the PRE-mix ``P_in`` to B and reset P, else ``P = P_in``;
    3. ``P = a`` or ``P + a`` with ``a = attn(h)``;  4. ``h2 = Mix(P, B; mlp_fold)``;  5. ``P = P + ffn(h2)``.
    Finally ``Mix(P, B; output_fold)``. The embedding is block 0.
    """
    partial: Tensor | None = embeddings
    blocks: list[Tensor] = []
    for layer, (attn, ffn, attn_fold, mlp_fold) in enumerate(layers):
        p_in = partial
        h = attn_res_mix(p_in, blocks, *attn_fold, eps) if blocks else p_in  # layer 0's attn fold is dead
        if layer % block_size == 0:
            blocks.append(p_in)
            partial = None
        a = attn(h)
        partial = a if partial is None else partial + a
        h2 = attn_res_mix(partial, blocks, *mlp_fold, eps)
        partial = partial + ffn(h2)
    return attn_res_mix(partial, blocks, *output_fold, eps)


def plain_residual_stack(embeddings: Tensor, layers: list[tuple[SubLayer, SubLayer]]) -> Tensor:
    """Kimi-Linear path without AttnRes (§3.1): ``h += attn(h)``, ``h += ffn(h)`` (K3 never takes it)."""
    h = embeddings
    for attn, ffn in layers:
        h = h + attn(h)
        h = h + ffn(h)
    return h


# --------------------------------------------------------------------------------------------------------------
# Text model
# --------------------------------------------------------------------------------------------------------------

_LM = "language_model.model."


def _decoder_sublayers(tc: dict, w: _Weights, layer: int) -> tuple[SubLayer, SubLayer]:
    p = f"{_LM}layers.{layer}."
    eps = tc["rms_norm_eps"]
    lac = tc.get("linear_attn_config")
    is_kda = lac is not None and (layer + 1) in lac["kda_layers"]  # 1-based layer lists (§5.1)
    is_moe = (
        tc.get("num_experts") is not None
        and layer >= tc["first_k_dense_replace"]
        and layer % tc.get("moe_layer_freq", 1) == 0
    )
    attn_fn = kda_attention if is_kda else mla_attention

    def attn(h: Tensor) -> Tensor:
        return attn_fn(tc, w, f"{p}self_attn.", rms_norm(h, w[f"{p}input_layernorm.weight"], eps))

    def ffn(h: Tensor) -> Tensor:
        x = rms_norm(h, w[f"{p}post_attention_layernorm.weight"], eps)
        if is_moe:
            return sparse_moe(tc, w, f"{p}block_sparse_moe.", x)
        return glu_mlp(
            tc, x, w[f"{p}mlp.gate_proj.weight"], w[f"{p}mlp.up_proj.weight"], w[f"{p}mlp.down_proj.weight"]
        )

    return attn, ffn


def text_hidden_states(tc: dict, w: _Weights, embeddings: Tensor) -> Tensor:
    """Decoder stack + final norm; embeddings [T, hidden] -> final hidden [T, hidden] (before lm_head)."""
    eps = tc["rms_norm_eps"]
    sublayers = [_decoder_sublayers(tc, w, layer) for layer in range(tc["num_hidden_layers"])]
    if tc.get("attn_res_block_size") is None:
        h = plain_residual_stack(embeddings, sublayers)
    else:
        layers = []
        for layer, (attn, ffn) in enumerate(sublayers):
            p = f"{_LM}layers.{layer}."
            attn_fold = (w[f"{p}self_attention_res_norm.weight"], w[f"{p}self_attention_res_proj.weight"])
            mlp_fold = (w[f"{p}mlp_res_norm.weight"], w[f"{p}mlp_res_proj.weight"])
            layers.append((attn, ffn, attn_fold, mlp_fold))
        output_fold = (w[f"{_LM}output_attn_res_norm.weight"], w[f"{_LM}output_attn_res_proj.weight"])
        h = block_attn_res_stack(embeddings, layers, output_fold, tc["attn_res_block_size"], eps)  # mix, then norm
    return rms_norm(h, w[f"{_LM}norm.weight"], eps)


def k3_reference_logits(
    config: dict,
    tensors: Mapping[str, Tensor],
    input_ids: Tensor,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
) -> Tensor:
    """Full K3 forward in float64: input_ids [B, T] -> logits [B, T, vocab].

    Images (HF-style, placeholders ALREADY expanded): ``input_ids`` holds one ``media_placeholder_token_id`` per
    merged patch group; the projector features of all images, in order, replace those positions' embeddings in
    row-major (batch, position) order. pixel_values [L, 3, p, p], image_grid_thw [N, 3] (t, h, w).
    """
    tc = config["text_config"]
    w = _Weights(tensors)
    embeds = w[f"{_LM}embed_tokens.weight"][input_ids]  # [B, T, hidden]
    if pixel_values is not None:
        features = k3_reference_image_features(config, tensors, pixel_values, image_grid_thw)
        mask = input_ids == config["media_placeholder_token_id"]
        if int(mask.sum()) != features.shape[0]:
            raise ValueError(f"{int(mask.sum())} placeholder tokens for {features.shape[0]} image features")
        embeds = embeds.clone()
        embeds[mask] = features
    lm_head = w["language_model.lm_head.weight"]
    return torch.stack([linear(text_hidden_states(tc, w, row), lm_head) for row in embeds])


def k3_reference_greedy(
    config: dict,
    tensors: Mapping[str, Tensor],
    input_ids: Tensor,
    max_new_tokens: int,
    pixel_values: Tensor | None = None,
    image_grid_thw: Tensor | None = None,
) -> Tensor:
    """Greedy decoding by repeated full forwards: input_ids [B, T] -> [B, T + max_new_tokens] int64 (no EOS stop)."""
    ids = input_ids.clone()
    for _ in range(max_new_tokens):
        logits = k3_reference_logits(config, tensors, ids, pixel_values, image_grid_thw)
        ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids


# --------------------------------------------------------------------------------------------------------------
# Vision tower (MoonViT3d) + projector (§3.9)
# --------------------------------------------------------------------------------------------------------------


def bilinear_resize(grid: Tensor, out_h: int, out_w: int) -> Tensor:
    """``F.interpolate(mode="bilinear", align_corners=False)`` by hand; grid [H, W, C] -> [out_h, out_w, C].

    Source coordinate ``(dst + 0.5) · in/out − 0.5`` clamped at 0; neighbours i0 and min(i0 + 1, in − 1).
    """
    in_h, in_w, _ = grid.shape

    def taps(out_size: int, in_size: int, dst: int) -> tuple[int, int, float]:
        src = max((dst + 0.5) * in_size / out_size - 0.5, 0.0)
        i0 = min(int(math.floor(src)), in_size - 1)
        i1 = min(i0 + 1, in_size - 1)
        return i0, i1, src - i0

    out = torch.zeros(out_h, out_w, grid.shape[2], dtype=grid.dtype)
    for r in range(out_h):
        r0, r1, lr = taps(out_h, in_h, r)
        for c in range(out_w):
            c0, c1, lc = taps(out_w, in_w, c)
            top = (1 - lc) * grid[r0, c0] + lc * grid[r0, c1]
            bottom = (1 - lc) * grid[r1, c0] + lc * grid[r1, c1]
            out[r, c] = (1 - lr) * top + lr * bottom
    return out


def rope_2d_angles(row: int, col: int, head_dim: int, theta: float = 10000.0) -> Tensor:
    """Angles of the head_dim/2 complex slots at patch (row, col): [head_dim/2].

    ``freq_i = θ^(-4i/head_dim)`` for i < head_dim/4; slots interleave ``[x_0, y_0, x_1, y_1, …]`` with
    x = column (width) index, y = row index (§3.9, §5.22).
    """
    angles = torch.zeros(head_dim // 2, dtype=torch.float64)
    for i in range(head_dim // 4):
        freq = theta ** (-4.0 * i / head_dim)
        angles[2 * i] = col * freq
        angles[2 * i + 1] = row * freq
    return angles


def apply_rope_interleaved(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate adjacent real pairs (x[2j], x[2j+1]) by angles[j] (view_as_complex convention); x [head_dim]."""
    out = torch.empty_like(x)
    for j in range(angles.shape[0]):
        cos, sin = math.cos(angles[j]), math.sin(angles[j])
        a, b = x[2 * j], x[2 * j + 1]
        out[2 * j] = a * cos - b * sin
        out[2 * j + 1] = a * sin + b * cos
    return out


def _vision_block(vc: dict, w: _Weights, p: str, x: Tensor, positions: list[tuple[int, int]], eps: float) -> Tensor:
    """One MoonViT encoder layer on one image; x [n, C] -> [n, C]. positions: (row, col) per patch."""
    heads = vc["vt_num_attention_heads"]
    qkv_width = vc.get("qkv_hidden_size") or vc["vt_hidden_size"]
    head_dim = qkv_width // heads
    n = x.shape[0]

    qkv = linear(rms_norm(x, w[f"{p}norm0.weight"], eps), w[f"{p}wqkv.weight"]).view(n, 3, heads, head_dim)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    angles = [rope_2d_angles(r, c, head_dim) for r, c in positions]
    q = torch.stack(
        [torch.stack([apply_rope_interleaved(q[i, h], angles[i]) for h in range(heads)]) for i in range(n)]
    )
    k = torch.stack(
        [torch.stack([apply_rope_interleaved(k[i, h], angles[i]) for h in range(heads)]) for i in range(n)]
    )
    attn = torch.zeros(n, heads, head_dim, dtype=x.dtype)
    for h in range(heads):
        probs = softmax((q[:, h] @ k[:, h].transpose(0, 1)) * head_dim**-0.5)  # non-causal within the image
        attn[:, h] = probs @ v[:, h]
    x = x + linear(attn.reshape(n, heads * head_dim), w[f"{p}wo.weight"])

    hidden = gelu_tanh(linear(rms_norm(x, w[f"{p}norm1.weight"], eps), w[f"{p}mlp.fc0.weight"]))
    return x + linear(hidden, w[f"{p}mlp.fc1.weight"])


def sd2_tpool_merge(x: Tensor, t: int, h: int, w: int, kernel: tuple[int, int] = (2, 2)) -> Tensor:
    """Merge one image: x [t·h·w, C] (raster order) -> [(h/kh)·(w/kw), kh·kw·C].

    ``(t, h/2, 2, w/2, 2, C) -> (t, h/2, w/2, 2, 2, C)``, mean over t, each group's 4 patches concatenated in
    (row, col) order (0,0), (0,1), (1,0), (1,1).
    """
    kh, kw = kernel
    C = x.shape[-1]
    grid = x.view(t, h, w, C)
    out = []
    for R in range(h // kh):
        for Cc in range(w // kw):
            parts = [grid[:, kh * R + i, kw * Cc + j].mean(dim=0) for i in range(kh) for j in range(kw)]
            out.append(torch.cat(parts))
    return torch.stack(out)


def k3_reference_image_features(
    config: dict,
    tensors: Mapping[str, Tensor],
    pixel_values: Tensor,
    grid_thw: Tensor,
    *,
    vision_norm_eps: float = VISION_NORM_EPS_FP32,
) -> Tensor:
    """MoonViT3d + sd2_tpool merge + PatchMergerMLPV2 in float64.

    pixel_values [L, 3, p, p] (the patches of all images, each in raster order), grid_thw [N, 3] (t, h, w), images
    only (t = 1) -> [Σ h·w/4, text_hidden]. ``vision_norm_eps``: eps of the ViT's eps-less nn.RMSNorm (see
    VISION_NORM_EPS_FP32).
    """
    vc = config["vision_config"]
    w = _Weights(tensors)
    patch_w = w["vision_tower.patch_embed.proj.weight"]  # Conv2d(3, C, p, stride p, bias=False) == a matmul per patch
    pos_emb = w["vision_tower.patch_embed.pos_emb.weight"]  # [H0, W0, C]
    pixels = pixel_values.to(torch.float64)

    features = []
    start = 0
    for t, h, wd in grid_thw.tolist():
        assert t == 1, "video (t > 1, time sin/cos embedding) is not covered by this reference"
        n = t * h * wd
        x = linear(pixels[start : start + n].reshape(n, -1), patch_w.reshape(patch_w.shape[0], -1))
        start += n
        pos = pos_emb if (h, wd) == tuple(pos_emb.shape[:2]) else bilinear_resize(pos_emb, h, wd)
        x = x + pos.reshape(h * wd, -1)
        positions = [(r, c) for r in range(h) for c in range(wd)]
        for i in range(vc["vt_num_hidden_layers"]):
            x = _vision_block(vc, w, f"vision_tower.encoder.blocks.{i}.", x, positions, vision_norm_eps)
        x = rms_norm(x, w["vision_tower.encoder.final_layernorm.weight"], vision_norm_eps)
        features.append(sd2_tpool_merge(x, t, h, wd, tuple(vc["merge_kernel_size"])))
    if start != pixels.shape[0]:
        raise ValueError(f"grid_thw covers {start} patches, pixel_values has {pixels.shape[0]}")

    merged = torch.cat(features)  # [Σ, 4·C]
    hidden = gelu_exact(linear(merged, w["mm_projector.proj.0.weight"]))
    out = linear(hidden, w["mm_projector.proj.2.weight"])
    return rms_norm(out, w["mm_projector.post_norm.weight"], vc["projector_ln_eps"])
