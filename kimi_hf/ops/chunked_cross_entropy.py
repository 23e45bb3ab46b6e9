"""The cross-entropy of a linear language-model head, computed in chunks: the logits [N, V] never exist whole.

For hidden states h [N, d], a head W [V, d] and targets t [N] (rows with t = ignore_index count for nothing),

    z = h W^T,   loss = sum_{i counted} lse_i - z_{i, t_i},   lse_i = logsumexp_v z_iv
    dz = g (softmax(z) - onehot(t)) on the counted rows (0 elsewhere),   dh = dz W,   dW = dz^T h

with g the loss's incoming gradient. z is rounded as the plain head rounds it (the matmul in W's dtype, or autocast's),
then taken to fp32, as transformers' ForCausalLMLoss upcasts the logits.

- forward: `chunk_size` rows at a time, z [chunk_size, V] in fp32 -> lse and the target's logit; autograd keeps h, t
  and lse [N] (fp32) only;
- backward: the vocabulary in slices of Vc = chunk_size x V / N rows of W (the same number of logits as a forward
  chunk), recomputing z [N, Vc]: dW of the slice is one matmul over all tokens (its sum over tokens is the matmul's
  own fp32 accumulation, no running sum across chunks, no [V, d] fp32 buffer), and dh is accumulated over the slices
  in an fp32 [N, d] buffer. Slicing the backward by vocabulary rather than by tokens is what makes both sums fp32 at
  the cost of an [N, d] buffer only.
Cost: one matmul more than the plain loss (z recomputed: 4 N V d multiply-adds against 3); memory beyond the inputs
and the head's gradient: one chunk's logits in fp32 and in the matmul's dtype (about (4 + 2 x its element size) x
chunk_size x V bytes at once) and the fp32 [N, d] dh buffer, against the plain loss's [N, V] logits in the model's
dtype, their fp32 copy, log-softmax and gradients (Kimi K3, 8192 tokens, bf16: 15.0 GB -> 3.3 GB at chunk_size 1024,
2.2 GB of which is the head's gradient; benchmarks/chunked_loss.py).

Tensor parallelism (vocabulary-parallel): W a DTensor sharded by rows over a 1-D mesh (transformers' lm_head plan
`colwise_gather_output`, whose plain forward gathers the whole logits): each rank works on its rows of the vocabulary
[V_r, d] only; lse combines the ranks' partial logsumexps (all-reduce max, then sum), the target's logit comes from the
rank that holds it (all-reduce sum), dW stays the rank's shard, dh (a partial sum over the vocabulary) is all-reduced.
Three all-reduces of [N] in the forward and one of [N, d] in the backward, against the plain path's all-gather of
[N, V] logits. The hidden states must be the same on every rank of the mesh (they are: the head's input is
replicated).

`chunked_causal_lm_loss` puts transformers' ForCausalLMLoss semantics (labels shifted inside unless `shift_labels`
are given, ignore_index, mean over the counted tokens or sum / num_items_in_batch) around it. A head that is not a
plain bias-free nn.Linear (a PEFT-wrapped or otherwise replaced module) runs through the module itself, chunk by
chunk under activation checkpointing: the same bound on the logits, its gradients summed by autograd.

Part of the flat, Hub-copyable model folder: torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint


REDUCTIONS = ("sum", "mean")


def _all_reduce(tensor: torch.Tensor, group, op=None) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor


def _global_logsumexp(lse: torch.Tensor, group) -> torch.Tensor:
    """logsumexp over the ranks of `group` of each rank's partial logsumexp lse [N] (its slice of the vocabulary)."""
    import torch.distributed as dist

    top = _all_reduce(lse.clone(), group, dist.ReduceOp.MAX)
    total = _all_reduce(torch.exp(lse - top), group)
    return top + torch.log(total)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """sum over the counted rows of lse_i - z_{i, t_i} (fp32 scalar), z = hidden @ weight^T in chunks (module
    docstring). weight [V_r, d] holds the vocabulary rows vocab_start .. vocab_start + V_r; with `group`, the other
    rows are the other ranks' (vocabulary-parallel)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size: int, ignore_index: int, vocab_start: int, group):
        n, rows = hidden.shape[0], weight.shape[0]
        local = targets - vocab_start
        counted = targets != ignore_index
        owned = counted & (local >= 0) & (local < rows)  # this rank's rows hold the target
        index = local.clamp(0, max(rows - 1, 0))[:, None]
        lse = hidden.new_empty(n, dtype=torch.float32)
        target_logit = hidden.new_zeros(n, dtype=torch.float32)
        compute_dtype = weight.dtype
        for i in range(0, n, chunk_size):
            z = F.linear(hidden[i : i + chunk_size], weight)  # the head's own rounding (autocast's, if on) ...
            compute_dtype = z.dtype
            z = z.float()  # ... then fp32, as ForCausalLMLoss upcasts
            picked = z.gather(1, index[i : i + chunk_size]).squeeze(1)
            target_logit[i : i + chunk_size] = torch.where(owned[i : i + chunk_size], picked, 0.0)
            top = z.amax(dim=-1, keepdim=True)  # logsumexp in place: no second [chunk_size, V] fp32 temporary
            lse[i : i + chunk_size] = z.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))
            del z
        if group is not None:
            lse = _global_logsumexp(lse, group)
            _all_reduce(target_logit, group)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_size, ctx.ignore_index, ctx.vocab_start, ctx.group = chunk_size, ignore_index, vocab_start, group
        ctx.compute_dtype = compute_dtype
        return torch.where(counted, lse - target_logit, 0.0).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, d = hidden.shape
        rows = weight.shape[0]
        cd = ctx.compute_dtype
        local = targets - ctx.vocab_start
        counted = targets != ctx.ignore_index
        owned = counted & (local >= 0) & (local < rows)
        scale = torch.where(counted, grad_loss.float(), 0.0)[:, None]  # g on the counted rows, 0 elsewhere
        h = hidden.to(cd)
        dh = hidden.new_zeros(n, d, dtype=torch.float32) if need_hidden else None
        dw = torch.empty_like(weight) if need_weight else None
        # vocabulary slices of as many logits as one forward chunk: [N, Vc] with N x Vc ~ chunk_size x V_r
        step = max(1, min(rows, ctx.chunk_size * rows // max(n, 1)))
        for v0 in range(0, rows, step):
            v1 = min(v0 + step, rows)
            w = weight[v0:v1].to(cd)
            p = F.linear(h, w).float().sub_(lse[:, None]).exp_()  # softmax(z)[:, v0:v1]
            inside = owned & (local >= v0) & (local < v1)
            p.scatter_add_(1, (local - v0).clamp(0, v1 - v0 - 1)[:, None], -inside.float()[:, None])
            dz = p.mul_(scale).to(cd)
            del p
            if need_hidden:
                if cd == torch.float32:
                    dh.addmm_(dz, w)
                else:
                    dh.add_(dz @ w)
            if need_weight and dw.dtype == cd:
                torch.mm(dz.t(), h, out=dw[v0:v1])  # written in place: no [Vc, d] temporary
            elif need_weight:  # autocast: the matmul in its dtype, the gradient in the weight's
                dw[v0:v1] = dz.t() @ h
            del dz
        if need_hidden and ctx.group is not None:
            _all_reduce(dh, ctx.group)  # each rank's dh sums over its slice of the vocabulary
        return (dh.to(hidden.dtype) if need_hidden else None), dw, None, None, None, None, None


def check_chunk_size(chunk_size, name: str = "chunk_size") -> None:
    """ValueError naming `name` unless chunk_size is a positive int (a number of tokens; not a bool)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name} must be a positive number of tokens, got {chunk_size!r}")


def _check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """A target outside the vocabulary (other than ignore_index) fails as F.cross_entropy fails, not silently:
    asynchronously on accelerators; skipped on the meta device (a memory plan's trace has no values)."""
    if targets.device.type == "meta":
        return
    valid = (targets == ignore_index) | ((targets >= 0) & (targets < vocab_size))
    torch._assert_async(valid.all(), f"cross-entropy targets must be ignore_index or in [0, {vocab_size})")


def _vocab_parallel(weight: torch.Tensor):
    """(local rows [V_r, d], their first vocabulary id, process group) of a head weight: a DTensor sharded by rows over
    a 1-D mesh is vocabulary-parallel; a replicated DTensor is its local tensor; a plain tensor is itself."""
    if not torch.distributed.is_available():
        return weight, 0, None
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(weight, DTensor):
        return weight, 0, None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return weight.to_local(), 0, None
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(
            f"the chunked cross-entropy takes a head weight sharded by vocabulary rows over a 1-D mesh (Shard(0), "
            f"tensor parallelism) or a replicated one; got placements {placements} over a {mesh.ndim}-D mesh"
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    return weight.to_local(), int(offset[0]), mesh.get_group()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=, reduction=) without the logits:
    hidden [N, d], weight [V, d] (or a DTensor of its rows sharded over a tensor-parallel mesh), targets [N] int.
    "mean" divides by the counted targets (nan when none is, as F.cross_entropy). Returns an fp32 scalar."""
    check_chunk_size(chunk_size)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden [N, d], weight [V, d] and targets [N]: got hidden {tuple(hidden.shape)}, weight "
            f"{tuple(weight.shape)}, targets {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden's width {hidden.shape[1]} is not the head's input width {weight.shape[1]}")
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(hidden, DTensor):
            raise TypeError("hidden must be a plain tensor (the head's input, replicated over a tensor-parallel mesh)")
    _check_targets(targets, weight.shape[0], ignore_index)
    local, vocab_start, group = _vocab_parallel(weight)
    loss = LinearCrossEntropyFunction.apply(hidden, local, targets, chunk_size, ignore_index, vocab_start, group)
    return loss / (targets != ignore_index).sum() if reduction == "mean" else loss


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=ignore_index, reduction="sum")


def module_cross_entropy(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *, chunk_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """The summed cross-entropy of head(hidden) [N, V] over targets [N], `chunk_size` rows at a time, each chunk
    under activation checkpointing (its logits recomputed in the backward): for any head module (PEFT-wrapped,
    biased, ...). Its parameters' gradients are summed by autograd, in their own dtype."""
    check_chunk_size(chunk_size)
    total = None
    for i in range(0, hidden.shape[0], chunk_size):
        part = checkpoint(
            _chunk_loss,
            head,
            hidden[i : i + chunk_size],
            targets[i : i + chunk_size],
            ignore_index,
            use_reentrant=False,
        )
        total = part if total is None else total + part
    return total


def _is_plain_linear(head: nn.Module) -> bool:
    """Exactly nn.Linear without a bias (not a subclass: quantized, FSDP-wrapped or adapter-carrying heads compute
    something else than weight @ h, or hold their weight elsewhere), and no accelerate hook (device_map offloading
    brings the weight in only around the module's own forward). Tensor parallelism's replaced forward is fine: the
    weight itself says how it is sharded."""
    return type(head) is nn.Linear and head.bias is None and not hasattr(head, "_hf_hook")


def chunked_causal_lm_loss(
    hidden_states: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor | None,
    *,
    chunk_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss(head(hidden_states), labels, ...) without the logits: hidden_states [B, T, d]
    (the decoder's output, before the head), labels [B, T] shifted here (position i predicts token i + 1), or
    shift_labels [B, T] already shifted (then labels is ignored). The mean over the counted tokens, or their sum over
    num_items_in_batch when given. A plain bias-free nn.Linear head (also under tensor parallelism) runs
    `linear_cross_entropy`; any other head `module_cross_entropy`. Other keyword arguments are ignored, as
    ForCausalLMLoss ignores them."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"labels of {tuple(shift_labels.shape)} for hidden states of {tuple(hidden_states.shape)}: one label a token"
        )
    if num_items_in_batch is None:
        num_items_in_batch = (targets != ignore_index).sum()
    if hidden.device.type != "meta":  # only the counted tokens go through the head (SFT masks most prompts);
        keep = targets != ignore_index  # the meta trace of a memory plan keeps every token (no values to select)
        hidden, targets = hidden[keep], targets[keep]
    if _is_plain_linear(head):
        hidden = hidden.to(head.weight.device)  # a model split over devices may end on another one than its head
        targets = targets.to(hidden.device)
        loss = linear_cross_entropy(
            hidden, head.weight, targets, chunk_size=chunk_size, ignore_index=ignore_index, reduction="sum"
        )
    else:
        loss = module_cross_entropy(hidden, head, targets, chunk_size=chunk_size, ignore_index=ignore_index)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


__all__ = [
    "LinearCrossEntropyFunction",
    "check_chunk_size",
    "chunked_causal_lm_loss",
    "linear_cross_entropy",
    "module_cross_entropy",
]
