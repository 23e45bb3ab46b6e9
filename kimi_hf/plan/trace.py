"""Activation memory by tracing the model on the meta device: every storage an op creates is recorded with its size
and the decoder layer that created it, and what is still alive after the forward (held for the backward by autograd,
by activation checkpointing or by the caller) is summed. Meta tensors have shapes and no data, so the real model's
own code runs at the released size (Kimi K3: 93 layers, hidden 7168, 896 experts) in seconds and without memory;
routing, which depends on values, is taken as balanced (`_RoutedExperts._route` on meta)."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


TOP = -1  # the tag of storages created outside every decoder layer (embedding, depth mixing, norm, head, loss)
FUSED_ATTENTION = "kimi_planner_fused"  # the attention implementation of a trace (`fused_attention`)


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (FlashAttention, PyTorch's memory-efficient SDPA: what a GPU runs for MLA,
    its v padded to the q / k head size) makes and keeps: the output [B, H, T, D] and the fp32 log-sum-exp [B, H, T],
    saved with q, k, v for the backward; never the [T, T] scores. On meta tensors, shapes only."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def fused_attention(module, query, key, value, attention_mask=None, **kwargs):
    """A transformers attention function (query / key / value [B, H, T, D]) -> ([B, T, H, D], None) with a fused
    kernel's memory: torch's SDPA on the meta device decomposes into the math path, which materialises the scores
    (at K3's 8192 tokens and 96 heads: tens of GB a layer that no GPU kernel makes)."""
    return _FusedAttention.apply(query, key, value).transpose(1, 2), None


def register_fused_attention() -> str:
    """Registers `fused_attention` with transformers' AttentionInterface; returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(FUSED_ATTENTION, fused_attention)
    return FUSED_ATTENTION


def _meta_grouped_mm(func, args, kwargs) -> torch.Tensor | None:
    """torch's meta kernel of `_grouped_mm` takes bf16 operands only (its CPU kernel, which a model saved in fp32
    runs, takes fp32 too): the fp32 / fp16 product's shape is the bf16 one's, in the operands' dtype."""
    if func is not torch.ops.aten._grouped_mm.default:
        return None
    a = args[0]
    if a.device.type != "meta" or a.dtype == torch.bfloat16:
        return None
    cast = [x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in args]
    return func(*cast, **(kwargs or {})).to(a.dtype)


class LiveStorages(TorchDispatchMode):
    """Records the storages created by the ops run under it: key -> (weak reference, bytes, tag). `tag` is the
    decoder layer running when the storage was made (TOP outside them); `peak` follows the live bytes when
    `follow_peak` is set (it prunes the dead on every op: for traces without autograd, whose live set is small)."""

    def __init__(self, exclude: set[int] = frozenset(), follow_peak: bool = False):
        super().__init__()
        self.exclude, self.follow_peak = exclude, follow_peak
        self.storages: dict[int, tuple[StorageWeakRef, int, int]] = {}
        self.tag, self.peak = TOP, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _meta_grouped_mm(func, args, kwargs)
        if out is None:
            out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                known = self.storages.get(key)
                if key not in self.exclude and (known is None or known[0].expired()):  # a freed key is reused
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes(), self.tag)
        if self.follow_peak:
            self.peak = max(self.peak, self.live())
        return out

    def prune(self) -> None:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}

    def live(self) -> int:
        """Bytes of the recorded storages still alive."""
        self.prune()
        return sum(nbytes for _, nbytes, _ in self.storages.values())

    def live_by_tag(self) -> dict[int, int]:
        self.prune()
        out: dict[int, int] = defaultdict(int)
        for _, nbytes, tag in self.storages.values():
            out[tag] += nbytes
        return dict(out)


def storage_keys(module: torch.nn.Module) -> set[int]:
    """The storages of a module's parameters and buffers (not activations)."""
    return {t.untyped_storage()._cdata for t in (*module.parameters(), *module.buffers())}


def tag_layers(mode: LiveStorages, layers) -> list:
    """Forward pre / post hooks that set mode.tag to the running decoder layer's index; returns their handles."""
    handles = []
    for i, layer in enumerate(layers):

        def enter(module, args, i=i):
            mode.tag = i

        def leave(module, args, out):
            mode.tag = TOP

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    return handles
