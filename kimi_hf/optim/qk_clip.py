"""QK-Clip (Kimi K2): keep every attention head's max pre-softmax logit at or below tau.

During training forwards each clipped attention module reports, per head, the max over the batch of
its pre-softmax logits (softmax scale included) to the `QKClip` attached to it. After each optimizer
step the maxima are all-reduced (MAX) across ranks, and every head h with S_h > tau gets
gamma_h = tau / S_h: the module rescales its own query/key weights so that head h's logits scale
by gamma_h (MLA: content parts by sqrt(gamma), the per-head rope query by gamma, the shared rope key
untouched). Heads at or below tau are never touched; KDA layers need no clip (q, k are L2-normalised).

A module takes part by having a method `apply_qk_clip(gamma: Tensor[H])` and `num_heads` (KimiHybridMLA
has both: the model says which heads exist and how to scale their rows, nothing more). Other transformers
attention modules with `q_proj` / `k_proj` linears and `head_dim` get a generic `apply_qk_clip`: head h's
query rows (and bias) scale by gamma, or by sqrt(gamma) with the key rows too when every query head has its
own key head. For every model, ours included, the max logits are recorded by one attention wrapper: the
model's attention implementation is switched to a recording wrapper of the one it had, which sees the
final (e.g. rotated) q and k.

How the max is obtained (and what it costs), per attention implementation:
- eager: exact, from q k^T in row blocks without gradient (one extra QK^T product);
- sdpa on CPU: from the fused kernel's row log-sum-exp, which it returns for free:
  max <= lse <= max + log(keys), an upper bound, so clipping is at most log(T) early;
- otherwise: exact, from q k^T computed in row blocks without gradient (costs about one more
  QK^T product of the attention).
Under tensor parallelism a module records only the heads its rank holds; `clip` places them at the rank's
slots before the all-reduce.
"""

from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS


_WRAPPER = "kimi_hf_qk_clip"


class QKClip:
    """Records per-head max logits of the model's attention modules and clips after each step."""

    def __init__(self, model: nn.Module, tau: float = 100.0, group=None):
        """group: the process group whose ranks hold the same attention modules (None: the world), over which
        the maxima are reduced."""
        if not tau > 0:
            raise ValueError(f"qk_clip_tau must be > 0, got {tau!r}")
        self.tau, self.group = float(tau), group
        _adopt_attention(model)
        self.modules = [m for m in model.modules() if callable(getattr(m, "apply_qk_clip", None))]
        for m in self.modules:
            m._qk_clip_recorder = self
        self._maxima: dict[int, torch.Tensor] = {}
        self.last_max_logit: float | None = None  # over all heads, at the last clip()
        self.last_head_max: list[torch.Tensor] = []  # per module of `modules`: its heads' maxima at the last clip()
        self.last_clipped_heads = 0
        self.total_clipped_heads = 0

    @torch.no_grad()
    def record(self, module: nn.Module, max_per_head: torch.Tensor) -> None:
        """Called by a module during a training forward with its max logit per head [H]."""
        key = id(module)
        m = max_per_head.detach().float()
        self._maxima[key] = m if key not in self._maxima else torch.maximum(self._maxima[key], m)

    @torch.no_grad()
    def clip(self) -> int:
        """All-reduce the recorded maxima, rescale heads above tau, reset. Returns heads clipped."""
        self.last_max_logit, self.last_clipped_heads, self.last_head_max = None, 0, []
        if not self.modules:
            return 0
        sizes = [getattr(m, "num_heads") for m in self.modules]
        device = next(self.modules[0].parameters()).device
        flat = torch.full((sum(sizes),), float("-inf"), device=device)
        for i, m in enumerate(self.modules):
            if id(m) in self._maxima:
                vals = self._maxima[id(m)].to(device)
                start = sum(sizes[:i]) + _local_head_offset(m, vals.numel(), sizes[i])
                flat[start : start + vals.numel()] = vals
        self._maxima.clear()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        if torch.isinf(flat).all():  # nothing recorded (no training forward since the last step)
            return 0
        self.last_max_logit = flat.max().item()
        self.last_head_max = list(flat.split(sizes))
        clipped = 0
        for m, heads in zip(self.modules, flat.split(sizes)):
            over = heads > self.tau
            if over.any():
                gamma = torch.where(over, self.tau / heads.clamp_min(self.tau), torch.ones_like(heads))
                m.apply_qk_clip(gamma)
                clipped += int(over.sum())
        self.last_clipped_heads = clipped
        self.total_clipped_heads += clipped
        return clipped


def _local_head_offset(module: nn.Module, local: int, total: int) -> int:
    """Where a module's `local` recorded heads start among its `total` heads: 0 unless tensor parallelism
    gave this rank a shard (its q weight is a DTensor on a mesh; torch.chunk order, as the TP plan shards)."""
    if local == total:
        return 0
    for p in module.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            if mesh.ndim == 1:
                return mesh.get_local_rank() * local
            # a 2-D mesh (tensor parallelism beside replicated data ranks): the dim that shards the heads (rows)
            for i, placement in enumerate(p.placements):
                if placement.is_shard(0):
                    return mesh.get_local_rank(i) * local
    raise ValueError(f"QK-Clip: {type(module).__name__} recorded {local} heads of {total} without a device mesh")


def _is_q_k_attention(m: nn.Module) -> bool:
    """A transformers attention module with q_proj / k_proj linears (and no QK-Clip of its own)."""
    return (
        isinstance(getattr(m, "q_proj", None), nn.Linear)
        and isinstance(getattr(m, "k_proj", None), nn.Linear)
        and isinstance(getattr(m, "head_dim", None), int)
        and not callable(getattr(m, "apply_qk_clip", None))
        and not getattr(m, "qk_clip_exempt", False)
    )


@torch.no_grad()
def _generic_apply_qk_clip(self, gamma: torch.Tensor) -> None:
    """Head h's logits scale by gamma[h]: sqrt on q and k rows when heads have their own key head,
    otherwise (GQA/MQA) the whole factor on the query rows."""
    d, H = self.head_dim, self.q_proj.out_features // self.head_dim
    gamma = gamma.float().to(self.q_proj.weight.device)
    shared_k = self.k_proj.out_features // d != H
    q_rows = (gamma if shared_k else gamma.sqrt()).repeat_interleave(d)
    targets = [(self.q_proj, q_rows)] + ([] if shared_k else [(self.k_proj, gamma.sqrt().repeat_interleave(d))])
    for proj, rows in targets:
        proj.weight.mul_(rows.to(proj.weight.dtype)[:, None])
        if proj.bias is not None:
            proj.bias.mul_(rows.to(proj.bias.dtype))


def attention_max_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    block: int = 256,
    causal: bool = True,
) -> torch.Tensor:
    """Exact per-head max over batch, queries and allowed keys of scaling * q.k, in row blocks and
    without gradient. query [B, H, T, D], key [B, H, S, D]; attention_mask: additive float or boolean
    (True = attend), or None: causal (the last T of S keys are the queries' own) or, causal=False, all keys."""
    with torch.no_grad():
        B, H, T, _ = query.shape
        S = key.shape[2]
        best = torch.full((H,), float("-inf"), device=query.device)
        for start in range(0, T, block):
            q = query[:, :, start : start + block].float()
            s = torch.matmul(q, key.float().transpose(-1, -2)) * scaling
            if attention_mask is not None:
                m = attention_mask[..., start : start + block, :S]
                s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.float()
            elif causal:
                rows = torch.arange(start, start + q.shape[2], device=q.device)[:, None] + (S - T)
                s = s.masked_fill(torch.arange(S, device=q.device)[None, :] > rows, float("-inf"))
            best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
        return best


def sdpa_cpu_with_lse(query, key, value, attention_mask, scaling, causal: bool = True):
    """CPU fused attention that also returns the row log-sum-exp [B, H, T] (free upper bound of
    the max logit: max <= lse <= max + log(keys)). query/key/value [B, H, T|S, D] (one head count, one
    head size); returns output [B, T, H, D] and lse."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # the kernel takes additive masks
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query,
        key,
        value,
        0.0,
        causal and attention_mask is None and query.shape[2] > 1,
        attn_mask=attention_mask,
        scale=scaling,
    )
    return out.transpose(1, 2), lse


def _plain_eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Softmax attention for a model module that defines no `eager_attention_forward` of its own."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        scores = (
            scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
        )
    weights = F.dropout(
        F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), p=dropout, training=module.training
    )
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _inner_attention(module: nn.Module, inner: str):
    """The implementation the wrapper stands in for: a registered one, or the model's own eager function."""
    if inner != "eager":
        return ALL_ATTENTION_FUNCTIONS[inner]
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", _plain_eager_attention)


def _recording_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention wrapper: records the per-head max logit in training, then runs the model's own attention
    implementation (on CPU under sdpa, the fused kernel that returns the log-sum-exp does both at once)."""
    recorder = getattr(module, "_qk_clip_recorder", None)
    inner = getattr(module, "_qk_clip_inner_attention", "sdpa")
    if recorder is None or not module.training:
        return _inner_attention(module, inner)(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    causal = getattr(module, "is_causal", True)
    plain = not kwargs.get("dropout") and all(kwargs.get(k) is None for k in ("softcap", "s_aux", "sliding_window"))
    if inner == "sdpa" and query.device.type == "cpu" and plain and key.shape[-1] == value.shape[-1]:
        k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out, lse = sdpa_cpu_with_lse(query, k, v, attention_mask, scale, causal)
        recorder.record(module, lse.detach().amax(dim=(0, 2)))
        return out, None
    maxima = attention_max_logits(query, key.repeat_interleave(groups, 1), attention_mask, scale, causal=causal)
    recorder.record(module, maxima)
    return _inner_attention(module, inner)(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _adopt_attention(model: nn.Module) -> None:
    """Gives q_proj/k_proj attention modules of other transformers models an apply_qk_clip and routes the
    model's attention (for every clipped module, ours included) through the recording wrapper of its
    current implementation."""
    for m in model.modules():
        if _is_q_k_attention(m):
            m.apply_qk_clip = types.MethodType(_generic_apply_qk_clip, m)
            m.num_heads = m.q_proj.out_features // m.head_dim
    clipped = [m for m in model.modules() if callable(getattr(m, "apply_qk_clip", None))]
    config = getattr(model, "config", None)
    if not clipped or config is None:
        return
    configs = {id(c): c for c in (getattr(m, "config", None) for m in clipped) if c is not None} or {
        id(config): config
    }
    for cfg in configs.values():
        inner = cfg._attn_implementation or "sdpa"
        if inner.startswith(_WRAPPER):
            continue
        # one name per wrapped implementation, so that masks keep the format that implementation expects
        wrapper = f"{_WRAPPER}_{inner}"
        AttentionInterface.register(wrapper, _recording_attention)
        masks = AttentionMaskInterface._global_mapping
        AttentionMaskInterface.register(wrapper, masks.get(inner, masks["sdpa"]))
        for m in clipped:
            if getattr(m, "config", cfg) is cfg:
                m._qk_clip_inner_attention = inner
        cfg._attn_implementation = wrapper


__all__ = ["QKClip", "attention_max_logits", "sdpa_cpu_with_lse"]
