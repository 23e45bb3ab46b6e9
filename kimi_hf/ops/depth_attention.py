"""Attention over depth (Attention Residuals, arXiv 2603.15031) as one op with a hand-written backward.

    out = sum_i alpha_i v_i,   alpha = softmax_i(l_i),   l_i = (v_i . w) * r_i,   r_i = rsqrt(mean(v_i^2) + eps)

over the sources v_i: completed blocks [n, B, T, d] (n >= 1) and an optional partial sum [B, T, d];
w = key-norm gain * pseudo-query [d]. The op is memory bound (a handful of passes over the sources
per sublayer), so the backward is written out: autograd's generic graph for the same formula makes
about three times as many passes and temporaries (norm masks, per-source products). Logits, softmax,
weights and the sums are fp32 whatever the sources' dtype.
"""

import torch
from torch.autograd.function import once_differentiable


def _sources(blocks: torch.Tensor, partial: torch.Tensor | None) -> list[torch.Tensor]:
    return list(blocks.float().unbind(0)) + ([partial.float()] if partial is not None else [])


def _logit_parts(vs: list[torch.Tensor], w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(v_i . w, r_i), each [n_sources, B, T] fp32: two passes over the sources, no normalised copy."""
    d = vs[0].shape[-1]
    dots = torch.stack([torch.mv(v.reshape(-1, d), w) for v in vs]).view(len(vs), *vs[0].shape[:-1])
    sq = torch.stack([torch.linalg.vector_norm(v, dim=-1) for v in vs]).square_()
    return dots, torch.rsqrt(sq.div_(d).add_(eps))


class DepthAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: torch.Tensor, eps: float, blocks: torch.Tensor, partial: torch.Tensor | None):
        w = w.float()
        vs = _sources(blocks, partial)
        dots, r = _logit_parts(vs, w, eps)
        alpha = (dots * r).softmax(0)
        out = vs[0] * alpha[0, ..., None]
        for a, v in zip(alpha[1:], vs[1:]):  # source by source: no [n, B, T, d] temporary
            out.addcmul_(a[..., None], v)
        ctx.save_for_backward(w, blocks, partial, alpha, r, dots)
        ctx.has_partial = partial is not None
        return out.to(blocks.dtype)

    @staticmethod
    @once_differentiable  # first-order only (a clear error for double backward)
    def backward(ctx, dout: torch.Tensor):
        w, blocks, partial, alpha, r, dots = ctx.saved_tensors
        d = blocks.shape[-1]
        dout = dout.float()
        vs = _sources(blocks, partial if ctx.has_partial else None)
        dalpha = torch.stack([torch.linalg.vecdot(v, dout) for v in vs])
        dlogit = alpha * (dalpha - (alpha * dalpha).sum(0, keepdim=True))
        c_w = dlogit * r  # d l_i / d v_i = r_i w - (v_i . w) r_i^3 v_i / d
        c_v = -(c_w * dots * r.square()) / d
        dw = torch.zeros_like(w)
        n = blocks.shape[0]
        dblocks = dout.new_empty((n, *dout.shape))  # written in place: no stack of per-block grads
        dpartial = None
        for i, v in enumerate(vs):
            g = torch.mul(dout, alpha[i, ..., None], out=dblocks[i]) if i < n else dout * alpha[i, ..., None]
            g.addcmul_(c_v[i, ..., None], v).addcmul_(c_w[i, ..., None], w)
            dw.addmv_(v.reshape(-1, d).t(), c_w[i].reshape(-1))
            dpartial = g if i == n else None
        dblocks = dblocks.to(blocks.dtype) if ctx.needs_input_grad[2] else None
        dpartial = dpartial.to(partial.dtype) if dpartial is not None and ctx.needs_input_grad[3] else None
        return dw, None, dblocks, dpartial


# Below this many values per source (B * T * d: decoding, short prompts), without autograd, the sources are
# stacked and handled in a few whole-tensor ops: at one token per step the per-source loop is launch-bound
SMALL_SOURCE_NUMEL = 1 << 16


def _depth_attention_small(w: torch.Tensor, blocks: torch.Tensor, partial: torch.Tensor | None, eps: float):
    """The same formula in five whole-tensor ops over the stacked fp32 sources (inference, small inputs)."""
    v = (torch.cat([blocks, partial[None]]) if partial is not None else blocks).float()  # [m, B, T, d]
    logits = (v @ w.float()) * torch.rsqrt(v.square().mean(-1) + eps)  # [m, B, T]
    alpha = logits.softmax(0)
    return (alpha[..., None] * v).sum(0).to(blocks.dtype)


def depth_attention(
    w: torch.Tensor, blocks: torch.Tensor, partial: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """w [d], blocks [n, B, T, d] (n >= 1), partial [B, T, d] or None -> [B, T, d] in blocks' dtype."""
    if blocks.dim() < 2 or blocks.shape[0] < 1:
        raise ValueError(f"blocks must be [n >= 1, ..., d], got shape {tuple(blocks.shape)}")
    if partial is not None and partial.shape != blocks.shape[1:]:
        raise ValueError(f"partial must have shape {tuple(blocks.shape[1:])}, got {tuple(partial.shape)}")
    if w.shape != blocks.shape[-1:]:
        raise ValueError(f"w must have shape ({blocks.shape[-1]},), got {tuple(w.shape)}")
    tensors = (w, blocks) if partial is None else (w, blocks, partial)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not grad and blocks[0].numel() <= SMALL_SOURCE_NUMEL:
        return _depth_attention_small(w, blocks, partial, eps)
    return DepthAttentionFunction.apply(w, eps, blocks, partial)


def depth_attention_weights(
    w: torch.Tensor, blocks: torch.Tensor, partial: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """[n (+ 1), B, T] fp32 softmax weights over the blocks (and the partial sum, last); no grad needed."""
    dots, r = _logit_parts(_sources(blocks, partial), w.float(), eps)
    return (dots * r).softmax(0)


def push_depth_output(
    partial: torch.Tensor, blocks: torch.Tensor, output: torch.Tensor, sublayer: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """After sublayer `sublayer`: its output opens a new partial sum when a block starts (the old one
    then joins the completed blocks: one copy per block, not per sublayer), else it accumulates."""
    if sublayer == 0:
        return output, blocks
    if sublayer % block_size == 0:
        return output, torch.cat([blocks, partial[None]])
    return partial + output, blocks


def depth_blocks_after(sublayers: int, block_size: int) -> int:
    """How many completed blocks `push_depth_output` holds after `sublayers` sublayers (the embedding counts: 1
    before the first): a new one each time a sublayer after the first starts a block. A pipeline stage's
    boundary tensor [n, B, T, d] has this n."""
    return 1 + max(sublayers - 1, 0) // block_size
