"""The hybrid KDA/MLA/MoE decoder (Kimi Linear layout) as transformers classes.

Layers are pre-norm blocks, x + Mixer(RMSNorm(x)) then x + FFN(RMSNorm(x)). The mixer is Kimi Delta
Attention (`KimiDeltaAttention`, running on `kda.chunk_kda` / `kda.recurrent_kda`) or MLA without
positional encoding (`KimiHybridMLA`); the FFN a SwiGLU or a DeepSeek-V3 style MoE.

Packed inputs (several documents per row, position_ids restarting at 0, no attention mask) run KDA
as variable-length sequences and mask MLA per document: nothing leaks across documents.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    find_packed_sequence_indices,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ...mx_block import MX_BLOCK
from ...ops.chunked_cross_entropy import chunked_causal_lm_loss
from ...ops.depth_attention import depth_attention, depth_attention_weights, push_depth_output
from ...ops.kda import chunk_kda, recurrent_kda
from ...ops.kda_context import chunk_kda_context_parallel
from ...ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from ...ops.mxfp4_matmul import mxfp4_grouped_linear
from ..hub_kimi import RemoteCodeMixin
from .cache_kimi_hybrid import KimiHybridCache
from .configuration_kimi_hybrid import KimiHybridTextConfig
from .context_kimi_hybrid import ContextParallelism, SequenceShard, check_context_parallel, shard_for_forward
from .conversion_mapping_kimi_hybrid import register as _register_conversion_mapping
from .parallel_kimi_hybrid import ATTN_RES_PP_ERROR, TensorParallelLoraCheck, check_parallel_layout
from .pipeline_kimi_hybrid import distribute_for_stage, prepare_stage_mesh, prune_to_active_stage


# from_pretrained of Moonshot's / transformers' Kimi-Linear layout converts at load time (per-expert w1/w2/w3,
# block_sparse_moe, A_log [1, 1, H, 1]); save_pretrained writes ours
_register_conversion_mapping()

# PEFT LoRA targets recommended for the hybrid model: the KDA and MLA projections and the dense /
# shared-expert SwiGLUs (routed experts are stacked parameters, not nn.Linear).
LORA_TARGET_MODULES = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]

# Up to this many new tokens on top of a longer cache, MLA attends over the latent (absorbed form).
_ABSORBED_MAX_TOKENS = 16
# Up to this many new tokens on top of a cached state, KDA runs the token loop (decoding); beyond, chunks.
_RECURRENT_MAX_TOKENS = 8


class KeepFP32Mixin:
    """Keeps the tensors named in `_fp32_tensors` in fp32 through `model.to(dtype)` / `.half()` / `.bfloat16()`
    (from_pretrained(dtype=...) keeps them through `_keep_in_fp32_modules_strict`): decays, gates and the
    router bias rounded to bf16 change what the model computes (a bf16 decay near 1 never forgets)."""

    _fp32_tensors: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in self._fp32_tensors:
            t = getattr(self, name)
            if t is not None and t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        return self


class KimiHybridRMSNorm(nn.Module):
    """RMSNorm computed in fp32; the weight multiplies the result cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class KimiHybridGatedRMSNorm(KeepFP32Mixin, nn.Module):
    """KDA's output norm: RMSNorm over head_dim (one weight shared by all heads) times sigmoid(gate), fp32
    (the weight too: Kimi K3's checkpoint stores o_norm in F32)."""

    _fp32_tensors = ("weight",)

    def __init__(self, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=torch.float32))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x * torch.sigmoid(gate.float())).to(dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    """Kimi K3's SiTU-GLU, in fp32, cast back to the input dtype:
    SiTU(a) = beta tanh(a / beta) sigmoid(a) (beta None or 0 means 1, as K3's `beta or 1.0`), times
    linear_beta tanh(up / linear_beta) (up unchanged when linear_beta is None). gate, up [..., I]."""
    beta = beta or 1.0
    a, u = gate.float(), up.float()
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (beta * torch.tanh(a / beta) * torch.sigmoid(a) * u).to(gate.dtype)


class KimiHybridGLU(nn.Module):
    """The gated activation of every FFN (dense MLP, shared and routed experts): act(gate) * up, or SiTU-GLU
    (`situ_glu`) with hidden_act "situ" (Kimi K3). gate, up [..., I] -> [..., I]."""

    def __init__(self, config: KimiHybridTextConfig):
        super().__init__()
        self.situ = config.hidden_act == "situ"
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        self.act_fn = None if self.situ else ACT2FN[config.hidden_act]

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.situ:
            return situ_glu(gate, up, self.beta, self.linear_beta)
        return self.act_fn(gate) * up


@dataclass
class PackedSequences:
    """Document structure of packed inputs, computed once per forward.

    pos_in_doc [B, T]: index of each token inside its document (restarts at 0);
    cu_seqlens [N + 1]: document offsets over the flattened B * T tokens (FlashAttention convention);
    last_doc [B]: index of each row's last document (for the per-row cached state).
    """

    pos_in_doc: torch.Tensor
    cu_seqlens: torch.Tensor
    last_doc: torch.Tensor

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, batch_size: int) -> "PackedSequences | None":
        if position_ids.shape[0] != batch_size:
            position_ids = position_ids.expand(batch_size, -1)
        doc = find_packed_sequence_indices(position_ids)
        if doc is None:
            return None
        B, T = doc.shape
        t = torch.arange(T, device=doc.device).expand(B, T)
        is_start = torch.ones_like(doc, dtype=torch.bool)
        is_start[:, 1:] = doc[:, 1:] != doc[:, :-1]
        pos_in_doc = t - torch.where(is_start, t, torch.zeros_like(t)).cummax(dim=1).values
        starts = is_start.flatten().nonzero().flatten()
        cu_seqlens = torch.cat([starts, starts.new_tensor([B * T])])
        last_doc = is_start.sum(1).cumsum(0) - 1
        return cls(pos_in_doc, cu_seqlens, last_doc)


def short_conv(
    x: torch.Tensor, weight: torch.Tensor, left: torch.Tensor | None = None, pos_in_doc: torch.Tensor | None = None
):
    """Depthwise causal convolution followed by SiLU.

    x [B, T, D]; weight [D, 1, W] (tap W-1 multiplies the current token); left [B, W-1, D]: the inputs
    before x (a cached state; zeros when None); pos_in_doc [B, T]: with packed documents, taps that
    would reach before the token's document start are dropped.
    """
    W, T = weight.shape[-1], x.shape[1]
    w = weight[:, 0, :].to(x.dtype)
    xe = torch.cat([left.to(x.dtype), x], 1) if left is not None else F.pad(x, (0, 0, W - 1, 0))
    y = x * w[:, W - 1]
    for j in range(1, W):
        tap = xe[:, W - 1 - j : W - 1 - j + T] * w[:, W - 1 - j]
        if pos_in_doc is not None:
            tap = tap * (pos_in_doc >= j).unsqueeze(-1).to(x.dtype)
        y = y + tap
    return F.silu(y)


class KimiHybridShortConv(KeepFP32Mixin, nn.Conv1d):
    """KDA's depthwise causal convolution (weight [D, 1, W], Conv1d's layout and state-dict name, kept fp32)
    run by `short_conv`: called as a module, so that accelerate's offload hooks load its weight first."""

    _fp32_tensors = ("weight",)

    def __init__(self, dim: int, kernel_size: int):
        super().__init__(dim, dim, kernel_size, groups=dim, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor, left: torch.Tensor | None = None, pos_in_doc: torch.Tensor | None = None):
        return short_conv(x, self.weight, left, pos_in_doc)


class KimiDeltaAttention(TensorParallelLoraCheck, KeepFP32Mixin, nn.Module):
    """Kimi Delta Attention layer (Kimi Linear, arXiv 2510.26692):
    q = L2Norm(SiLU(Conv(W_q x))), k = L2Norm(SiLU(Conv(W_k x))), v = SiLU(Conv(W_v x))
    g = kda_gate(W_fb W_fa x; A_log, dt_bias),  beta = sigmoid(W_b x)   (the gate: kimi_hf.ops.kda_inputs.kda_gate)
    o = W_o(RMSNorm_head(KDA(q, k, v, g, beta)) * sigmoid(W_gb W_ga x))
    Kimi K3's options: the safe gate (kda_gate with kda_gate_lower_bound) and a full-rank output gate
    sigmoid(W_g x) (kda_full_rank_output_gate).
    """

    qk_clip_exempt = True  # q and k are L2-normalised: logits are bounded by the scale, no QK-Clip
    _fp32_tensors = ("A_log", "dt_bias")

    def __init__(self, config: KimiHybridTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.linear_num_heads, config.linear_head_dim
        self.conv_size = config.linear_conv_kernel_dim
        hidden, dim = config.hidden_size, self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, dim, bias=False)
        self.k_proj = nn.Linear(hidden, dim, bias=False)
        self.v_proj = nn.Linear(hidden, dim, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (KimiHybridShortConv(dim, self.conv_size) for _ in range(3))
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        # fp32 whatever the default dtype the model is built in (and kept so by KeepFP32Mixin / from_pretrained)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        if config.kda_full_rank_output_gate:  # Kimi K3: one full-rank output gate
            self.g_proj = nn.Linear(hidden, dim, bias=False)
        else:  # Kimi Linear: low rank through head_dim
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.full_rank_gate = config.kda_full_rank_output_gate
        self.lower_bound = config.kda_gate_lower_bound  # Kimi K3's safe gate when set
        self.o_norm = KimiHybridGatedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(dim, hidden, bias=False)

    def _convolve(
        self, x: torch.Tensor, cache: Cache | None, packed: PackedSequences | None, context: SequenceShard | None
    ):
        """q, k, v projections through their short convolutions; keeps the last W-1 inputs in the cache. Under
        context parallelism the W-1 inputs before this rank's first token come from the previous rank."""
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, 3D]
        caching = cache is not None and self.conv_size > 1
        prev = cache.get_conv_state(self.layer_idx) if caching else None  # [B, 3D, W-1], updated in place below
        left = (None,) * 3 if prev is None else prev.transpose(1, 2).chunk(3, -1)
        pos = packed.pos_in_doc if packed is not None else None
        if context is not None and self.conv_size > 1:
            left = context.left_context(mixed, self.conv_size - 1).chunk(3, -1)  # [B, W-1, 3D]
            pos = context.pos_in_doc  # global positions: taps into the previous rank's part of a document count
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        out = [conv(m, l, pos) for m, l, conv in zip(mixed.chunk(3, -1), left, convs)]
        if caching:
            cache.update_conv_state(mixed.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_size - 1)
        return out

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        packed: PackedSequences | None = None,
        context: SequenceShard | None = None,
        **kwargs,
    ):
        if attention_mask is not None:  # 2D padding mask: padded tokens become no-ops (k = v = 0)
            hidden_states = hidden_states * attention_mask[:, :, None].to(hidden_states.dtype)
        B, T, _ = hidden_states.shape
        shape = (B, T, -1, self.head_dim)  # -1: this rank's heads under tensor parallelism
        q, k, v = (t.view(shape) for t in self._convolve(hidden_states, past_key_values, packed, context))
        # raw forget input and beta logits: the gate activation, sigmoid and q/k L2 norm run inside the
        # KDA op (fused into the Triton kernels on CUDA, in fp32 torch on CPU)
        f = self.f_b_proj(self.f_a_proj(hidden_states)).view(shape)
        beta = self.b_proj(hidden_states)
        fused = dict(
            use_qk_l2norm=True,
            use_gate_in_kernel=True,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            use_beta_sigmoid_in_kernel=True,
        )
        if self.lower_bound is not None:  # the safe gate (kda_gate with a lower bound), in the op
            fused.update(safe_gate=True, lower_bound=self.lower_bound)
        state = past_key_values.get_recurrent_state(self.layer_idx) if past_key_values is not None else None
        cache_state = past_key_values is not None
        if context is not None:  # the sequence split over ranks: their state maps composed (ops/kda_context.py)
            args = (q, k, v, f, beta)
            cp = dict(group=context.cp.group, continues=context.continues)
            if packed is not None:  # each row's first document follows the previous row's last
                args = [t.reshape(1, B * T, *t.shape[2:]) for t in args]
                first = torch.cat([packed.last_doc.new_zeros(1), packed.last_doc[:-1] + 1])
                cp.update(cu_seqlens=packed.cu_seqlens, first_seq=first, last_seq=packed.last_doc)
            o = chunk_kda_context_parallel(*args, **cp, **fused).view(B, T, *v.shape[2:])
            S = None
        elif packed is not None:  # documents as variable-length sequences of one flattened row
            flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, f, beta)]
            o, S = chunk_kda(*flat, cu_seqlens=packed.cu_seqlens, output_final_state=cache_state, **fused)
            o, S = o.view(B, T, *o.shape[2:]), (S[packed.last_doc] if cache_state else None)
        elif state is not None and T <= _RECURRENT_MAX_TOKENS:
            o, S = recurrent_kda(q, k, v, f, beta, initial_state=state, output_final_state=True, **fused)
        else:
            o, S = chunk_kda(q, k, v, f, beta, initial_state=state, output_final_state=cache_state, **fused)
        if cache_state:
            past_key_values.update_recurrent_state(S, self.layer_idx)
        gate = self.g_proj(hidden_states) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(hidden_states))
        return self.o_proj(self.o_norm(o, gate.view(shape)).reshape(B, T, -1))


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """query [B, H, T, D], key/value [B, H or fewer (GQA), S, D] -> output [B, T, H, Dv], weights
    [B, H, T, S]. attention_mask: additive float or boolean (True = attend)."""
    if key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        scores = (
            scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
        )
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class KimiHybridMLA(TensorParallelLoraCheck, nn.Module):
    """Multi-head Latent Attention without positional encoding (Kimi Linear's MLA).

    The cache keeps the compressed latent (kv_lora_rank normalised values + the qk_rope_head_dim
    key part shared by all heads); kv_b_proj expands it to per-head keys and values at each call.
    """

    def __init__(self, config: KimiHybridTextConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1
        self.is_causal = True
        self.attention_dropout = config.attention_dropout
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = config.qk_head_dim, config.v_head_dim
        hidden = config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = KimiHybridRMSNorm(self.q_lora_rank, eps=config.mla_latent_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=config.attention_bias
        )
        # an identity on kv_a_proj_with_mqa's output (a LoRA adapter's included), where tensor parallelism sums the
        # rope key's gradient over the ranks' heads (parallel_kimi_hybrid.TP_PLAN); no parameters
        self.kv_a_output = nn.Identity()
        self.kv_a_layernorm = KimiHybridRMSNorm(self.kv_lora_rank, eps=config.mla_latent_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=config.attention_bias)
        # Kimi K3: the attention output times sigmoid(g_proj(x)), per channel of the H * v_head_dim output
        self.g_proj = (
            nn.Linear(hidden, self.num_heads * self.v_head_dim, bias=False) if config.mla_use_output_gate else None
        )
        self.scaling = self.qk_head_dim**-0.5

    @torch.no_grad()
    def apply_qk_clip(self, gamma: torch.Tensor) -> None:
        """QK-Clip for MLA: head h's logits scale by gamma[h]. Its q-nope rows and the k-nope rows of
        kv_b_proj scale by sqrt(gamma), its rope query rows by gamma; the rope key, shared by all
        heads, is never touched. gamma: one factor per head of the model, or per local head (tensor parallelism:
        the heads this rank's shard holds). kimi_hf.optim.QKClip records the max logits (an attention wrapper)."""
        nope, rope, v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        q_weight = self.q_proj.weight if self.q_lora_rank is None else self.q_b_proj.weight
        local_heads = (q_weight.to_local() if hasattr(q_weight, "to_local") else q_weight).shape[0] // self.qk_head_dim
        if gamma.ndim != 1 or gamma.shape[0] not in (self.num_heads, local_heads):
            raise ValueError(
                f"apply_qk_clip: gamma must hold one factor per head ({self.num_heads}) or per local head "
                f"({local_heads}), got shape {tuple(gamma.shape)}"
            )
        H = gamma.shape[0]
        gamma = gamma.float()
        root = gamma.sqrt()[:, None]
        q_rows = torch.cat([root.expand(H, nope), gamma[:, None].expand(H, rope)], 1).flatten()
        kv_rows = torch.cat([root.expand(H, nope), torch.ones(H, v, device=gamma.device)], 1).flatten()
        for weight, rows in ((q_weight, q_rows), (self.kv_b_proj.weight, kv_rows)):
            local = weight.to_local() if hasattr(weight, "to_local") else weight
            if local.shape[0] != rows.shape[0]:  # FSDP2 / TP shard on dim 0: this rank's rows (torch.chunk split)
                mesh = weight.device_mesh
                rows = rows.chunk(mesh.size(0))[mesh.get_local_rank()]
            local.mul_(rows.to(local.device, local.dtype)[:, None])

    def project_query(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> queries [B, H, T, qk_head_dim] (H: this rank's heads under tensor parallelism)."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(*x.shape[:2], -1, self.qk_head_dim).transpose(1, 2)

    def expand_latent(self, latent: torch.Tensor, k_rope: torch.Tensor):
        """latent [B, 1, S, kv_lora_rank], k_rope [B, 1, S, rope] -> keys [B, H, S, qk], values [B, H, S, v]."""
        B, _, S, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(B, S, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
        k_nope, value = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        key = torch.cat([k_nope, k_rope.expand(B, kv.shape[1], S, -1)], dim=-1)
        return key, value

    def absorbed_attention(self, query, latent, k_rope, attention_mask, filled=None):
        """Decoding without expanding the cache: kv_b_proj is folded into the query and the output,
        q_nope . (W_k c_j) = (W_k^T q_nope) . c_j and sum_j p_j W_v c_j = W_v sum_j p_j c_j, so each
        head attends over the shared latent [S, kv_lora_rank + rope] (MQA-like): O(S * rank) per
        step instead of running kv_b_proj over all S cached tokens.
        query [B, H, T, qk]; latent [B, 1, S, R]; k_rope [B, 1, S, rope] -> [B, T, H, v]. filled: how many of
        the S cached positions hold tokens (an int or a 0-d tensor; a pre-allocated StaticCache is longer than
        that), the new T tokens being the last of them; None: all S."""
        w = self.kv_b_proj.weight
        w = w.to_local() if hasattr(w, "to_local") else w  # tensor parallelism: this rank's heads (rows) of a DTensor
        w = w.view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_k, w_v = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
        q_nope, q_rope = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, w_k), q_rope], dim=-1)
        k = torch.cat([latent, k_rope], dim=-1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scaling  # [B, H, T, S]
        T, S = scores.shape[-2:]
        filled = S if filled is None else filled
        # sdpa may skip the mask: the new tokens are causal, within the filled length (a one-token step over a
        # fully filled cache, the common decode, needs none)
        if attention_mask is None and (T > 1 or not isinstance(filled, int) or filled != S):
            rows = torch.arange(T, device=q.device)[:, None] + (filled - T)
            attention_mask = torch.arange(S, device=q.device)[None, :] <= rows  # no host sync for a tensor `filled`
        if attention_mask is not None:
            mask = attention_mask[..., :S]
            if mask.dtype == torch.bool:  # sdpa-style masks: True = attend
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.einsum("bhtr,hvr->bthv", torch.matmul(probs, latent), w_v)
        return out

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        context: SequenceShard | None = None,
        **kwargs,
    ):
        B, T, _ = hidden_states.shape
        query = self.project_query(hidden_states)
        latent, k_rope = self.kv_a_output(self.kv_a_proj_with_mqa(hidden_states)).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent).view(B, 1, T, self.kv_lora_rank)
        k_rope = k_rope.view(B, 1, T, self.qk_rope_head_dim)
        if context is not None:  # context parallelism: every rank's latent (small), this rank's queries
            latent, k_rope = context.gather(torch.cat([latent, k_rope], -1), 2).split(
                [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
            )
        if past_key_values is not None:  # the cache stores the compressed latent, not per-head keys
            latent, k_rope = past_key_values.update(latent, k_rope, self.layer_idx)
            # absorbed decoding reads kv_b_proj's weight directly: not for a LoRA-wrapped kv_b_proj, nor under
            # accelerate's offload hooks (they load a weight only when its module is called)
            if (
                T <= _ABSORBED_MAX_TOKENS < latent.shape[2]
                and type(self.kv_b_proj) is nn.Linear
                and not hasattr(self.kv_b_proj, "_hf_hook")
                and not kwargs.get("output_attentions")
            ):
                filled = past_key_values.layers[self.layer_idx].get_seq_length()
                out = self.absorbed_attention(query, latent, k_rope, attention_mask, filled)
                return self.o_proj(self.output_gate(out.reshape(B, T, -1), hidden_states)), None
        key, value = self.expand_latent(latent, k_rope)
        impl = self.config._attn_implementation
        # SDPA's fused kernels need one head size for q, k and v; with v_head_dim < qk_head_dim they
        # fall back to the math path (5x slower on CPU at T=2048): pad v with zeros, slice after (flash
        # kernels need it too; only eager, which materialises the scores, gains nothing).
        eager = impl == "eager" or impl.endswith("_eager")  # QK-Clip's recording wrapper of eager too
        pad = self.qk_head_dim - self.v_head_dim if not eager else 0
        if pad > 0:
            value = F.pad(value, (0, pad))
        dropout = 0.0 if not self.training else self.attention_dropout
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        out, weights = attention(
            self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
        )
        if pad > 0:
            out = out[..., : self.v_head_dim]
        return self.o_proj(self.output_gate(out.reshape(B, T, -1), hidden_states)), weights

    def output_gate(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out [B, T, H v] times sigmoid(g_proj(x)) per channel (mla_use_output_gate), else out."""
        return out if self.g_proj is None else out * torch.sigmoid(self.g_proj(x))


class KimiHybridMLP(TensorParallelLoraCheck, nn.Module):
    """Gated FFN: down(GLU(gate(x), up(x))), SwiGLU or SiTU-GLU (`KimiHybridGLU`)."""

    def __init__(self, config: KimiHybridTextConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.glu = KimiHybridGLU(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))


class KimiHybridRouter(KeepFP32Mixin, nn.Module):
    """DeepSeek-V3 noaux_tc router: fp32 logits, sigmoid scores, experts chosen on scores +
    e_score_correction_bias (within the best topk_group groups), weighted by the uncorrected scores
    of the chosen experts (renormalised if norm_topk_prob) times routed_scaling_factor. The weight and
    the bias stay fp32 (and the token counts of `expert_load`: bf16 would stop counting exactly at 256)."""

    _fp32_tensors = ("weight", "e_score_correction_bias", "expert_load")

    def __init__(self, config: KimiHybridTextConfig):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        # Auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 §2.1.2): with `track_load` on (the optim
        # package's ExpertBiasCallback turns it on), training forwards add the tokens each expert received to
        # `expert_load`, from which the correction bias is updated after each optimizer step. Off by default.
        self.track_load = False
        self.register_buffer("expert_load", torch.zeros(self.num_experts, dtype=torch.float32), persistent=False)

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [N, E] -> sigmoid scores [N, E] fp32, the chosen experts [N, k] (the one place the
        choice is made: the forward and the load-balancing loss both call it)."""
        scores = logits.float().sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            kept_groups = torch.zeros_like(group_scores).scatter_(
                1, group_scores.topk(self.topk_group, dim=-1).indices, 1.0
            )
            choice = choice.masked_fill(
                ~kept_groups.bool().repeat_interleave(self.num_experts // self.n_group, dim=1), float("-inf")
            )
        return scores, choice.topk(self.top_k, dim=-1).indices

    def forward(self, x: torch.Tensor):
        """x [N, hidden] -> router_logits [N, E] fp32, weights [N, k] fp32, expert indices [N, k]."""
        logits = F.linear(x.float(), self.weight.float())
        scores, indices = self.select(logits)
        # counted once per forward: not again when gradient checkpointing recomputes it during the backward
        if self.track_load and self.training and torch._C._current_graph_task_id() == -1:
            self.expert_load += torch.bincount(indices.reshape(-1), minlength=self.num_experts).float()
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, indices


class _RoutedExperts(nn.Module):
    """What the two forms of the routed experts share: their sizes, the gate activation, the grouping of routed rows by
    expert (one sort) and the static-shape forward for torch.compile. A subclass holds the weights and says how to get
    expert e's (`expert_weights`)."""

    def __init__(self, config: KimiHybridTextConfig):
        super().__init__()
        # Stable LatentMoE (Kimi K3): the experts' input and output width is the latent routed_expert_hidden_size
        self.num_experts = config.num_experts
        self.hidden = config.routed_expert_hidden_size or config.hidden_size
        self.intermediate = config.moe_intermediate_size
        self.glu = KimiHybridGLU(config)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[S, 2I] (gate rows first) -> [S, I]: the activation transformers' experts implementations call."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.glu(gate, up)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, hidden], down [hidden, I]) in dtype."""
        raise NotImplementedError

    def _route(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """indices [N, k] -> (order: the routed slots sorted by expert, token: each slot's row of x, counts: slots per
        expert). Under expert parallelism num_experts is this rank's count and an index num_experts marks a route to
        another rank's expert (weight 0): those slots sort last and are dropped."""
        flat = indices.flatten()
        order = flat.argsort(stable=True)
        if flat.is_meta:  # no values to count (the memory planner's trace, kimi_hf/plan): balanced routing
            share, extra = divmod(flat.numel(), self.num_experts)
            return order, order // indices.shape[1], [share + (e < extra) for e in range(self.num_experts)]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()[: self.num_experts]
        order = order[: sum(counts)]
        return order, order // indices.shape[1], counts

    @staticmethod
    def _combine(x: torch.Tensor, y: torch.Tensor, order, token, weights: torch.Tensor) -> torch.Tensor:
        """The routed outputs y [slots, hidden] (in `order`) weighted and summed back into x's rows."""
        y = y * weights.flatten()[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y)

    def _dense_forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the [N, E] routing matrix (zero where not chosen): static
        shapes, E times the routed compute."""
        routing = torch.zeros(x.shape[0], self.num_experts + 1, device=x.device, dtype=weights.dtype)  # + EP sentinel
        routing = routing.scatter_add(1, indices, weights)[:, : self.num_experts].to(x.dtype)
        y = torch.zeros_like(x)
        for e in range(self.num_experts):
            gate_up, down = self.expert_weights(e, x.dtype)
            y = y + routing[:, e, None] * F.linear(self._apply_gate(F.linear(x, gate_up)), down)
        return y


@use_experts_implementation
class KimiHybridExperts(_RoutedExperts):
    """Routed SwiGLU experts stored stacked: gate_up_proj [E, 2I, hidden] (gate rows first),
    down_proj [E, hidden, I] (transformers' concatenated, non-transposed experts layout). The forward is
    transformers' experts interface (`experts_implementation`: "grouped_mm" by default, "batched_mm", or
    "eager" = the loop below: tokens grouped by expert with one sort, one matmul per expert)."""

    def __init__(self, config: KimiHybridTextConfig):
        super().__init__(config)
        E, H, inter = self.num_experts, self.hidden, self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj[e], self.down_proj[e]

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]; indices, weights [N, k] -> [N, hidden] (routes to another rank's expert skipped)."""
        if torch.compiler.is_compiling():  # no host sync (bincount().tolist()) in a traced or exported graph
            return self._dense_forward(x, indices, weights)
        order, token, counts = self._route(indices)
        outs = [
            F.linear(self._apply_gate(F.linear(seg, self.gate_up_proj[e])), self.down_proj[e])
            for e, seg in enumerate(x[token].split(counts))
            if counts[e]
        ]
        if not outs:
            return torch.zeros_like(x)
        return self._combine(x, torch.cat(outs), order, token, weights)


MXFP4_TRAINING_ERROR = (
    "the routed experts are kept as their MXFP4 bytes (experts_format='mxfp4'), which cannot be trained, but this "
    "MoE layer is being trained in full (its router requires grad), so its experts would silently stay as they are: "
    "load the model with from_pretrained(..., experts_format='dense') to train the experts, train adapters instead "
    "(PEFT LoRA, e.g. target_modules=kimi_hf.lora_target_modules(config), freezes the rest), or freeze the MoE layers' own "
    "weights (requires_grad_(False))"
)


class KimiHybridMxfp4Experts(_RoutedExperts):
    """The routed experts kept as their MXFP4 bytes (Kimi K3's release, `experts_format="mxfp4"`), stacked per layer
    in the dense experts' layout: gate_up_proj [E, 2I, hidden / 2] uint8 (two E2M1 codes a byte, gate rows first)
    with gate_up_proj_scale [E, 2I, hidden / 32] uint8 (E8M0, one per 32 inputs), down_proj [E, hidden, I / 2] with
    down_proj_scale [E, hidden, I / 32] (ops/mxfp4.py has the format). The same names and dims as the dense
    parameters, so the TP / EP plans and the load-time conversion address both (a TP rank's slice of down_proj's
    input holds whole 32-value blocks: checked at load). Frozen: the bytes take no gradient, the input does (LoRA
    adapters before and after the experts train through them). Each expert with tokens is dequantised on the fly,
    one at a time (ops/mxfp4_matmul.py; a Triton kernel on CUDA decodes tiles in registers instead)."""

    def __init__(self, config: KimiHybridTextConfig):
        super().__init__(config)
        E, H, inter = self.num_experts, self.hidden, self.intermediate
        if H % MX_BLOCK or inter % MX_BLOCK:
            raise ValueError(
                f"experts_format='mxfp4': the experts' widths ({H}, moe_intermediate_size {inter}) must be multiples "
                f"of {MX_BLOCK}, the MXFP4 block"
            )

        def frozen(*shape):
            return nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)

        self.gate_up_proj, self.gate_up_proj_scale = frozen(E, 2 * inter, H // 2), frozen(E, 2 * inter, H // MX_BLOCK)
        self.down_proj, self.down_proj_scale = frozen(E, H, inter // 2), frozen(E, H, inter // MX_BLOCK)

    def dequantized(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """gate_up_proj / down_proj as the dense experts hold it, [E, out, in] of dtype (exact; all experts at once:
        for tests, merging and export, not the forward)."""
        return dequantize_mxfp4(getattr(self, name), getattr(self, name + "_scale"), dtype=dtype, name=name)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e dequantised (exact): the static-shape path's weights."""
        return tuple(
            dequantize_mxfp4(getattr(self, n)[e], getattr(self, n + "_scale")[e], dtype=dtype)
            for n in ("gate_up_proj", "down_proj")
        )

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]; indices, weights [N, k] -> [N, hidden], as KimiHybridExperts."""
        if torch.compiler.is_compiling():  # no host sync (bincount().tolist()) in a traced or exported graph
            return self._dense_forward(x, indices, weights)
        order, token, counts = self._route(indices)
        h = mxfp4_grouped_linear(x[token], self.gate_up_proj, self.gate_up_proj_scale, counts)
        y = mxfp4_grouped_linear(self._apply_gate(h), self.down_proj, self.down_proj_scale, counts)
        return self._combine(x, y, order, token, weights)


class KimiHybridMoE(TensorParallelLoraCheck, nn.Module):
    """Routed experts plus always-on shared experts. With routed_expert_hidden_size (Kimi K3's Stable LatentMoE)
    the router still reads the full hidden x, the routed experts run on z = routed_expert_down_proj(x) and their
    weighted sum r returns through routed_expert_up_proj(RMSNorm(r)) (the norm with latent_moe_use_norm); the
    shared experts run on the full x."""

    def __init__(self, config: KimiHybridTextConfig):
        super().__init__()
        self.gate = KimiHybridRouter(config)
        # Kimi K3 loaded with experts_format="mxfp4" keeps the routed experts as their released bytes
        resident = getattr(config, "experts_format", "dense") == "mxfp4"
        self.experts = (KimiHybridMxfp4Experts if resident else KimiHybridExperts)(config)
        latent = config.routed_expert_hidden_size
        if latent is not None:
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent, bias=False)
            self.routed_expert_up_proj = nn.Linear(latent, config.hidden_size, bias=False)
            self.routed_expert_norm = (
                KimiHybridRMSNorm(latent, eps=config.rms_norm_eps) if config.latent_moe_use_norm else None
            )
        self.latent = latent is not None
        self.shared_experts = (
            KimiHybridMLP(config, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.training
            and torch.is_grad_enabled()
            and isinstance(self.experts, KimiHybridMxfp4Experts)
            and self.gate.weight.requires_grad
        ):
            raise ValueError(MXFP4_TRAINING_ERROR)
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = self.gate(flat)
        if self.latent:
            y = self.experts(self.routed_expert_down_proj(flat), indices, weights)
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y).view_as(x)
        else:
            y = self.experts(flat, indices, weights).view_as(x)
        return y + self.shared_experts(x) if self.shared_experts is not None else y


class KimiHybridDepthKeyNorm(nn.Module):
    """The keys' RMSNorm of depth attention, folded into the query: q . (g * x / rms(x)) = ((g * q) . x) / rms(x),
    so it returns g * q [d] (fp32); the division by rms(x) happens in `depth_attention`. A module call (not a
    read of `.weight`), so that accelerate's offload hooks load g first."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, query: torch.Tensor) -> torch.Tensor:
        return self.weight.float() * query.float()


class KimiHybridDepthAttention(nn.Module):
    """Attention Residuals (arXiv 2603.15031): a sublayer's input is softmax attention over depth,
    x = sum_i softmax_i(q . RMSNorm(v_i)) v_i over the sources: the completed blocks [n, B, T, d]
    (the embedding first) and the current partial sum [B, T, d] (None before the first sublayer).
    The pseudo-query q starts at zero (a uniform average: the residual sum up to the scale that the
    next RMSNorm removes); keys have their own RMSNorm; no temperature; softmax and sums in fp32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm = KimiHybridDepthKeyNorm(hidden_size, eps=eps)

    def normed_query(self) -> torch.Tensor:
        return self.key_norm(self.query)

    def weights(self, blocks: torch.Tensor, partial: torch.Tensor | None = None) -> torch.Tensor:
        """[n (+ 1), B, T] fp32 weights over the blocks (and the partial sum, last)."""
        return depth_attention_weights(self.normed_query(), blocks, partial, self.key_norm.variance_epsilon)

    def forward(self, blocks: torch.Tensor, partial: torch.Tensor | None = None) -> torch.Tensor:
        return depth_attention(self.normed_query(), blocks, partial, self.key_norm.variance_epsilon)


class KimiHybridDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: token mixer (KDA or MLA), then SwiGLU or MoE. With Attention Residuals the
    layer maps the depth sources [n, B, T, d] to the new sources instead of a residual stream."""

    def __init__(self, config: KimiHybridTextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.block_size = config.resolved_attn_residual_block_size()
        if self.block_size is not None:
            self.attn_res = KimiHybridDepthAttention(config.hidden_size, config.rms_norm_eps)
            self.mlp_res = KimiHybridDepthAttention(config.hidden_size, config.rms_norm_eps)
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = (
            KimiHybridMLA(config, layer_idx)
            if self.layer_type == "full_attention"
            else KimiDeltaAttention(config, layer_idx)
        )
        self.mlp = KimiHybridMoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else KimiHybridMLP(config)
        self.input_layernorm = KimiHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        depth_blocks: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        packed: PackedSequences | None = None,
        context: SequenceShard | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        """hidden_states [B, T, d] -> [B, T, d]; with Attention Residuals (partial sum, completed
        blocks [n, B, T, d]) -> (the partial sum, the completed blocks [n', B, T, d] if a block
        completed in this layer, else None: the caller keeps its own) after this layer's two
        sublayers (both inputs positional, so that gradient checkpointing propagates gradients to both)."""

        def mix(h):
            h = self.input_layernorm(h)
            if self.layer_type == "full_attention":
                return self.self_attn(
                    h, attention_mask=attention_mask, past_key_values=past_key_values, context=context, **kwargs
                )[0]
            return self.self_attn(
                h, attention_mask=attention_mask, past_key_values=past_key_values, packed=packed, context=context
            )

        if self.block_size is None:
            hidden_states = hidden_states + mix(hidden_states)
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        # Attention Residuals: hidden_states is the current partial sum, depth_blocks the completed blocks
        s, partial, blocks = 2 * self.layer_idx, hidden_states, depth_blocks
        out = mix(self.attn_res(blocks, partial if s > 0 else None))
        partial, blocks = push_depth_output(partial, blocks, out, s, self.block_size)
        out = self.mlp(self.post_attention_layernorm(self.mlp_res(blocks, partial)))
        partial, blocks = push_depth_output(partial, blocks, out, s + 1, self.block_size)
        # unchanged blocks are not handed back: under FSDP2 depth_blocks is its autograd view of the input (and
        # before the first cat, the embedding's [None] view), which would come out of the layer as a view tensor
        return partial, (None if blocks is depth_blocks else blocks)


class KimiHybridPreTrainedModel(RemoteCodeMixin, PreTrainedModel):
    config: KimiHybridTextConfig
    config_class = KimiHybridTextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiHybridDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_attention_backend = True
    _is_stateful = True
    # torch.compile(fullgraph=True) traces forward and backward (the chunked KDA is a custom op, experts run without
    # host syncs): generate compiles its decoding steps with a compileable cache (e.g. cache_implementation="static")
    _can_compile_fullgraph = True
    # decays, gates, short convs and the router stay fp32 under from_pretrained(dtype=bf16 / fp16), as
    # Kimi-Linear's checkpoints store them (model.to(dtype) keeps them too: KeepFP32Mixin)
    _keep_in_fp32_modules_strict = [
        "A_log",
        "dt_bias",
        "q_conv1d",
        "k_conv1d",
        "v_conv1d",
        "e_score_correction_bias",
        "gate.weight",
        "o_norm",
    ]
    _can_record_outputs = {
        "router_logits": OutputRecorder(KimiHybridRouter, index=0),
        "hidden_states": KimiHybridDecoderLayer,
        "attentions": OutputRecorder(KimiHybridMLA, index=1),
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """Every model of this family routes its experts through KimiHybridExperts (`@use_experts_implementation`,
        this module). transformers' heuristic looks for the decorator in the class's own module source, and caches
        its answer on the class: a subclass in another module (Kimi K3's) was refused when it asked first, and got
        its base's answer when the base had asked first."""
        return True

    @classmethod
    def prepare_distribute_model(cls, distributed_config, device_map=None):
        """transformers' meshes, with the pipeline dimension when one stage loads with expert / tensor parallelism
        (kimi_hf.distributed.load_pipeline_stage: prepare_stage_mesh)."""
        prepared = prepare_stage_mesh(distributed_config, device_map)
        return prepared if prepared is not None else super().prepare_distribute_model(distributed_config, device_map)

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' parallelism at load time (docs/parallelism.md), after two checks made on every rank at once:
        pipeline parallelism is refused with Attention Residuals (in the forward, a later stage would wait for a
        tensor that never comes), and tensor parallelism by head needs heads divisible by tp_size."""
        prune_to_active_stage(model)  # kimi_hf.distributed.load_pipeline_stage: before any tensor is read
        if distributed_config is not None:
            check_parallel_layout(model.config.get_text_config(), model.tp_plan, distributed_config)
        return distribute_for_stage(super().maybe_distribute_model, model, distributed_config, mesh_manager)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiDeltaAttention):  # as Kimi Linear / fla initialise them
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif isinstance(module, KimiHybridExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiHybridMxfp4Experts):  # a model built from a config: normal weights, MX-rounded
            for name in ("gate_up_proj", "down_proj"):
                packed = getattr(module, name)
                if packed.device.type != "meta" and not getattr(packed, "_is_hf_initialized", False):
                    dense = torch.empty(*packed.shape[:-1], 2 * packed.shape[-1]).normal_(0.0, std)
                    packed_bytes, scale = quantize_mxfp4(dense, name=name, exact=False)
                    init.copy_(packed, packed_bytes)
                    init.copy_(getattr(module, name + "_scale"), scale)
        elif isinstance(module, KimiHybridRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
            init.zeros_(module.expert_load)
        elif isinstance(module, (KimiHybridRMSNorm, KimiHybridGatedRMSNorm, KimiHybridDepthKeyNorm)):
            init.ones_(module.weight)
        elif isinstance(module, KimiHybridDepthAttention):
            if self.config.get_text_config().attn_residual_query_init == "normal":  # K3 trains its *_res_proj so
                init.normal_(module.query, mean=0.0, std=std)
            else:  # uniform depth weights at the start
                init.zeros_(module.query)


class KimiHybridTextModel(KimiHybridPreTrainedModel):
    def __init__(self, config: KimiHybridTextConfig):
        super().__init__(config)
        config.check_token_ids()  # before nn.Embedding asserts on an out-of-range padding_idx
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([KimiHybridDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KimiHybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.resolved_attn_residual_block_size() is not None:  # the last depth attention, before the final norm
            self.final_res = KimiHybridDepthAttention(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        # context parallelism (kimi_hf.distributed.context.enable_context_parallel): None, one whole sequence a rank
        self._context_parallel: ContextParallelism | None = None
        self.post_init()

    def positions(self, inputs_embeds, position_ids=None, attention_mask=None, past_key_values=None):
        """(position_ids [1 or B, T], packed documents or None) for inputs_embeds [B, T, d]. Packed documents
        (position_ids restart, no padding mask, nothing cached yet): KDA runs them as varlen sequences and the MLA
        mask is built per document. Only given position_ids can restart (the check reads their values: not for our
        own positions, which also keeps export traceable)."""
        B, T = inputs_embeds.shape[:2]
        past_seen = _cached_length(past_key_values)
        if position_ids is None:
            return (torch.arange(T, device=inputs_embeds.device) + past_seen).unsqueeze(0), None
        if attention_mask is None and past_seen == 0:
            return position_ids, PackedSequences.from_position_ids(position_ids, B)
        return position_ids, None

    def layer_masks(self, inputs_embeds, attention_mask, position_ids, past_key_values=None, packed=None) -> dict:
        """{layer type: mask} for the decoder's layers: the causal (per-document) mask of MLA layers, the padding
        mask of KDA layers (None where nothing needs masking)."""
        if isinstance(attention_mask, dict):  # {layer_type: mask} built by generate() for compileable caches
            return attention_mask
        # positional: the cache argument is `past_key_values` before transformers 5.24, `cache` after
        mask_args = (self.config, inputs_embeds, attention_mask, None if packed is not None else past_key_values)
        present = set(self.config.layer_types)  # the causal mask needs attention layers in the cache
        masks = {}
        if "full_attention" in present:
            masks["full_attention"] = create_causal_mask(*mask_args, position_ids=position_ids)
        if "linear_attention" in present:
            masks["linear_attention"] = create_recurrent_attention_mask(*mask_args)
        return masks

    def context_positions(self, inputs_embeds, position_ids=None, attention_mask=None, past_key_values=None):
        """Under context parallelism (`_context_parallel` set), (position_ids, packed, masks, SequenceShard) of this
        rank's slice inputs_embeds [B, T, d] (kimi_hf.distributed.context): global positions, documents across the
        cut, MLA's mask over the gathered sequence; ValueError for what it does not run. The whole decoder and a
        pipeline stage (KimiPipelineStageModule) call it."""
        B, T = inputs_embeds.shape[:2]
        check_context_parallel(self.config, T, attention_mask, past_key_values)
        position_ids, context = shard_for_forward(self._context_parallel, B, T, position_ids, inputs_embeds.device)
        packed = PackedSequences.from_position_ids(position_ids, B)
        return position_ids, packed, {"full_attention": context.attention_mask, "linear_attention": None}, context

    def start_blocks(self, inputs_embeds: torch.Tensor) -> torch.Tensor | None:
        """The completed depth blocks before the first layer: the embedding as block 0 [1, B, T, d] (None without
        Attention Residuals)."""
        return None if self.config.resolved_attn_residual_block_size() is None else inputs_embeds[None]

    def run_layers(
        self,
        hidden_states: torch.Tensor,
        blocks: torch.Tensor | None,
        layer_indices,
        masks: dict,
        position_ids: torch.Tensor,
        past_key_values: Cache | None = None,
        packed: PackedSequences | None = None,
        context: SequenceShard | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs the layers `layer_indices` (in order): hidden_states [B, T, d] (with Attention Residuals the partial
        sum) and blocks ([n, B, T, d] completed depth blocks, or None) -> the same pair after them. The whole
        decoder runs range(num_layers); a pipeline stage its own range (kimi_hf.distributed.pipeline). The mask is
        taken by the config's layer type."""
        layer_types = self.config.layer_types
        for i in layer_indices:
            out = self.layers[i](
                hidden_states,
                blocks,
                attention_mask=masks[layer_types[i]],
                position_ids=position_ids,
                past_key_values=past_key_values,
                packed=packed,
                context=context,
                **kwargs,
            )
            if blocks is None:
                hidden_states = out
            else:  # (partial sum, the new blocks or None: no block completed in that layer)
                hidden_states, new_blocks = out
                blocks = blocks if new_blocks is None else new_blocks
        return hidden_states, blocks

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        past_key_values = cache if cache is not None else past_key_values  # transformers >= 5.24 says `cache`
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        context = None
        if self._context_parallel is not None:  # this rank's slice of sequences split over a group: no cache
            position_ids, packed, masks, context = self.context_positions(
                inputs_embeds, position_ids, attention_mask, past_key_values
            )
        else:
            if use_cache and past_key_values is None:
                past_key_values = KimiHybridCache(config=self.config)
            position_ids, packed = self.positions(inputs_embeds, position_ids, attention_mask, past_key_values)
            masks = self.layer_masks(inputs_embeds, attention_mask, position_ids, past_key_values, packed)
        if self.config.resolved_attn_residual_block_size() is not None:
            # (a layer wrapped by torch's checkpoint_wrapper, as accelerate's fsdp_activation_checkpointing does, is
            # still one; transformers' naive pipeline puts placeholders in place of another stage's layers)
            if any(
                not isinstance(getattr(layer, "_checkpoint_wrapped_module", layer), KimiHybridDecoderLayer)
                for layer in self.layers
            ):
                raise NotImplementedError(ATTN_RES_PP_ERROR)
        hidden_states, blocks = self.run_layers(
            inputs_embeds,
            self.start_blocks(inputs_embeds),
            range(len(self.layers)),
            masks,
            position_ids,
            past_key_values,
            packed,
            context,
            **kwargs,
        )
        if blocks is not None:
            hidden_states = self.final_res(blocks, hidden_states)
        return MoeModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states), **_cache_field(MoeModelOutputWithPast, past_key_values)
        )


def _cache_field(output_cls, cache) -> dict:
    """The cache under the output class's field name (`past_key_values` before transformers 5.24, `cache` since)."""
    return {"cache" if "cache" in output_cls.__dataclass_fields__ else "past_key_values": cache}


def _output_cache(output):
    return getattr(output, "cache" if "cache" in output.__dataclass_fields__ else "past_key_values")


def _cached_length(cache: Cache | None) -> int:
    """Tokens already in the cache. A cache without MLA layers does not count tokens: then only
    whether anything is cached matters (KDA uses no positions)."""
    if cache is None:
        return 0
    try:
        return cache.get_seq_length()
    except ValueError:
        return int(any(any(getattr(layer, "has_previous_state", {}).values()) for layer in cache.layers))


def router_load_balancing_loss(router_logits, routers, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-style auxiliary loss for sigmoid routers over all MoE layers: E * sum_e f_e * P_e, with f_e the
    fraction of (non-padding) token slots routed to expert e (the experts each layer's router actually chose:
    correction bias and group limits included, through `KimiHybridRouter.select`) and P_e its mean normalised
    score. router_logits: one [N, E] tensor per MoE layer run, in order; routers: the layers' routers."""
    if len(router_logits) % len(routers):
        raise ValueError(f"{len(router_logits)} router_logits for {len(routers)} MoE layers")
    routers = routers * (len(router_logits) // len(routers))
    chosen, probs = [], []
    for logits, router in zip(router_logits, routers):
        scores, indices = router.select(logits.to(router.e_score_correction_bias.device))
        E = scores.shape[-1]
        chosen.append(F.one_hot(indices, E).sum(1).float() / indices.shape[1])
        probs.append(scores / scores.sum(-1, keepdim=True))
    chosen, probs = torch.cat(chosen), torch.cat(probs)  # [L * N, E]
    if attention_mask is not None and attention_mask.ndim == 2:
        valid = attention_mask.reshape(-1).to(probs.device).repeat(len(router_logits)).float()[:, None]
        if valid.shape[0] == probs.shape[0]:
            return E * ((chosen * valid).sum(0) / valid.sum() * (probs * valid).sum(0) / valid.sum()).sum()
    return E * (chosen.mean(0) * probs.mean(0)).sum()


class KimiHybridForCausalLM(KimiHybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # the decoder's plans are the config's base_model_*_plan (docs/parallelism.md)
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    text_model_class = KimiHybridTextModel  # Kimi K3's text-only subclass sets its own

    def __init__(self, config: KimiHybridTextConfig):
        super().__init__(config)
        self.model = self.text_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        """Logits of the last `logits_to_keep` positions (0: all) and, with labels, the shifted cross-entropy. With
        `config.loss_chunk_size` set, a forward with labels returns the loss and `logits=None`: the head and the loss
        run in chunks of tokens, the logits never whole (`lm_output`)."""
        past_key_values = cache if cache is not None else past_key_values
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        return lm_output(
            self, outputs, self.config, labels, attention_mask, logits_to_keep, output_router_logits, **kwargs
        )


def lm_output(
    model: PreTrainedModel,
    outputs: MoeModelOutputWithPast,
    text_config: KimiHybridTextConfig,
    labels,
    attention_mask,
    logits_to_keep,
    output_router_logits: bool,
    output_cls: type = MoeCausalLMOutputWithPast,
    **kwargs,
) -> MoeCausalLMOutputWithPast:
    """The language-model head on a decoder's outputs: logits (of the last `logits_to_keep` positions),
    the shifted cross-entropy when labels are given, plus the weighted router load-balancing loss
    when `output_router_logits`. Shared by the text-only and the multimodal models.

    With `text_config.loss_chunk_size` set (`model.config.get_text_config().loss_chunk_size = n`), a forward with
    labels over every position (logits_to_keep 0) computes the head and the loss together, n tokens at a time
    (`chunked_causal_lm_loss`: the same loss and gradients, the [B, T, V] logits never whole) and returns the loss
    with `logits=None`. Without labels, or with logits_to_keep, the logits are computed as usual."""
    loss = aux_loss = None
    chunk = text_config.loss_chunk_size
    if labels is not None and chunk is not None and isinstance(logits_to_keep, int) and logits_to_keep == 0:
        if model.loss_function is not ForCausalLMLoss:  # a replaced loss function needs the logits
            raise ValueError(
                f"loss_chunk_size computes transformers' ForCausalLMLoss, but this model's loss_function is "
                f"{getattr(model.loss_function, '__name__', model.loss_function)!r}: set loss_chunk_size=None to use it"
            )
        logits = None
        loss = chunked_causal_lm_loss(outputs.last_hidden_state, model.lm_head, labels, chunk_size=chunk, **kwargs)
    else:
        positions = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = model.lm_head(outputs.last_hidden_state[:, positions, :])
        if labels is not None:
            loss = model.loss_function(logits=logits, labels=labels, vocab_size=text_config.vocab_size, **kwargs)
    if output_router_logits and outputs.router_logits:
        routers = [m for m in model.modules() if isinstance(m, KimiHybridRouter)]
        aux_loss = router_load_balancing_loss(outputs.router_logits, routers, attention_mask)
        if loss is not None:
            loss = loss + text_config.router_aux_loss_coef * aux_loss.to(loss.device)
    # the multimodal model's output class also carries image_outputs (the vision tower's, passed through)
    extra = {"image_outputs": outputs.image_outputs} if output_cls is not MoeCausalLMOutputWithPast else {}
    return output_cls(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
        **extra,
        **_cache_field(output_cls, _output_cache(outputs)),
    )


__all__ = [
    "LORA_TARGET_MODULES",
    "KimiHybridPreTrainedModel",
    "KimiHybridTextModel",
    "KimiHybridForCausalLM",
    "KimiDeltaAttention",
    "KimiHybridMLA",
    "KimiHybridMoE",
]
