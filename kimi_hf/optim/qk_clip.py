"""QK-Clip (Kimi K2): keep every attention head's max pre-softmax logit at or below tau.

During training forwards each clipped attention module reports, per head, the max over the batch of
its pre-softmax logits (softmax scale included) to the `QKClip` attached to it. After each optimizer
step the maxima are all-reduced (MAX) across ranks, and every head h with S_h > tau gets
gamma_h = tau / S_h: the module rescales its own query/key weights so that head h's logits scale
by gamma_h (MLA: content parts by sqrt(gamma), the per-head rope query by gamma, the shared rope key
untouched). Heads at or below tau are never touched; KDA layers need no clip (q, k are L2-normalised).

A module takes part by having an attribute `max_logit_recorder` (set here) and a method
`apply_qk_clip(gamma: Tensor[H])` (KimiHybridMLA has both). Other transformers attention modules with
`q_proj` / `k_proj` linears and `head_dim` take part through `GenericQKClip`: the model's attention
implementation is switched to a recording wrapper of the one it had, which sees the final (e.g.
rotated) q and k; head h's query rows (and bias) scale by gamma, or by sqrt(gamma) with the key rows
too when every query head has its own key head.

How the max is obtained (and what it costs), per attention implementation:
- eager: exact, from the materialised scores (one extra reduction);
- sdpa on CPU: from the fused kernel's row log-sum-exp, which it returns for free:
  max <= lse <= max + log(keys), an upper bound, so clipping is at most log(T) early;
- otherwise: exact, from q k^T computed in row blocks without gradient (costs about one more
  QK^T product of the attention).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..models.kimi_hybrid.modeling_kimi_hybrid import attention_max_logits, eager_attention_forward

_WRAPPER = "kimi_hf_qk_clip"


class QKClip:
    """Records per-head max logits of the model's attention modules and clips after each step."""

    def __init__(self, model: nn.Module, tau: float = 100.0):
        if not tau > 0:
            raise ValueError(f"qk_clip_tau must be > 0, got {tau!r}")
        self.tau = float(tau)
        _adopt_generic_attention(model)
        self.modules = [m for m in model.modules() if callable(getattr(m, "apply_qk_clip", None))]
        for m in self.modules:
            m.max_logit_recorder = self
        self._maxima: dict[int, torch.Tensor] = {}
        self.last_max_logit: float | None = None  # over all heads, at the last clip()
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
        self.last_max_logit, self.last_clipped_heads = None, 0
        if not self.modules:
            return 0
        sizes = [getattr(m, "num_heads") for m in self.modules]
        device = next(self.modules[0].parameters()).device
        flat = torch.full((sum(sizes),), float("-inf"), device=device)
        for i, m in enumerate(self.modules):
            if id(m) in self._maxima:
                flat[sum(sizes[:i]) : sum(sizes[: i + 1])] = self._maxima[id(m)].to(device)
        self._maxima.clear()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        if torch.isinf(flat).all():  # nothing recorded (no training forward since the last step)
            return 0
        self.last_max_logit = flat.max().item()
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


def _is_generic_attention(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "q_proj", None), nn.Linear) and isinstance(getattr(m, "k_proj", None), nn.Linear)
            and isinstance(getattr(m, "head_dim", None), int) and not callable(getattr(m, "apply_qk_clip", None))
            and not getattr(m, "qk_clip_exempt", False))


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


def _recording_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention wrapper: records the per-head max logit in training, then runs the model's own
    attention implementation."""
    recorder = getattr(module, "max_logit_recorder", None)
    if recorder is not None and module.training:
        k = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        recorder.record(module, attention_max_logits(query, k, attention_mask, scale))
    inner = getattr(module, "_qk_clip_inner_attention", "sdpa")
    fn = eager_attention_forward if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]
    return fn(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def _adopt_generic_attention(model: nn.Module) -> None:
    """Gives q_proj/k_proj attention modules of other transformers models an apply_qk_clip and
    routes the model's attention through the recording wrapper of its current implementation."""
    generic = [m for m in model.modules() if _is_generic_attention(m)]
    config = getattr(model, "config", None)
    if not generic or config is None:
        return
    inner = config._attn_implementation or "sdpa"
    if inner.startswith(_WRAPPER):
        return
    # one name per wrapped implementation, so that masks keep the format that implementation expects
    wrapper = f"{_WRAPPER}_{inner}"
    AttentionInterface.register(wrapper, _recording_attention)
    masks = AttentionMaskInterface._global_mapping
    AttentionMaskInterface.register(wrapper, masks.get(inner, masks["sdpa"]))
    for m in generic:
        m.apply_qk_clip = types.MethodType(_generic_apply_qk_clip, m)
        m._qk_clip_inner_attention = inner
        m.num_heads = m.q_proj.out_features // m.head_dim
    for sub in model.modules():  # every config object that carries the implementation
        cfg = getattr(sub, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == inner:
            cfg._attn_implementation = wrapper


__all__ = ["QKClip"]
