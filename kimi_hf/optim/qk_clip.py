"""QK-Clip (Kimi K2): keep every attention head's max pre-softmax logit at or below tau.

During training forwards each clipped attention module reports, per head, the max over the batch of
its pre-softmax logits (softmax scale included) to the `QKClip` attached to it. After each optimizer
step the maxima are all-reduced (MAX) across ranks, and every head h with S_h > tau gets
gamma_h = tau / S_h: the module rescales its own query/key weights so that head h's logits scale
by gamma_h (MLA: content parts by sqrt(gamma), the per-head rope query by gamma, the shared rope key
untouched). Heads at or below tau are never touched; KDA layers need no clip (q, k are L2-normalised).

A module takes part by having an attribute `max_logit_recorder` (set here) and a method
`apply_qk_clip(gamma: Tensor[H])`; see KimiHybridMLA.

How the max is obtained (and what it costs), per attention implementation:
- eager: exact, from the materialised scores (one extra reduction);
- sdpa on CPU: from the fused kernel's row log-sum-exp, which it returns for free:
  max <= lse <= max + log(keys), an upper bound, so clipping is at most log(T) early;
- otherwise: exact, from q k^T computed in row blocks without gradient (costs about one more
  QK^T product of the attention).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class QKClip:
    """Records per-head max logits of the model's attention modules and clips after each step."""

    def __init__(self, model: nn.Module, tau: float = 100.0):
        if not tau > 0:
            raise ValueError(f"qk_clip_tau must be > 0, got {tau!r}")
        self.tau = float(tau)
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


__all__ = ["QKClip"]
