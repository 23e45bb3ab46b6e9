"""MuonClip: Muon for hidden matrices + AdamW for everything else, one torch optimizer.

Muon step for a matrix W [A, B] (or a batch [E, A, B] of expert matrices, each orthogonalised):
    buf <- mu * buf + (1 - mu) * g                  (fp32 momentum, never touched in place afterwards)
    M = g + mu * (buf - g)  if nesterov else buf     (= g.lerp(buf, mu))
    O = NewtonSchulz5(M)                             (~ U V^T, singular values in ~[0.5, 1.5])
    W <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(A, B)) * O      (Moonlight: AdamW's update RMS)
Other parameter groups get AdamW with the same lr and weight decay. With QK-Clip attached
(`from_model(..., qk_clip_tau=...)` or `attach_qk_clip`), attention heads whose max pre-softmax
logit exceeded tau are rescaled after every step (see qk_clip.py).

Distributed: under DDP (replicated parameters, gradients already all-reduced) every rank keeps the
momentum of every matrix but orthogonalises only its own share (matrices dealt round-robin), and
one all-reduce of the flat update buffer shares the results: identical to a single-process step.
Under FSDP2 or tensor parallelism (DTensor parameters) each matrix's momentum-updated gradient is
all-gathered once, orthogonalised whole, and each rank keeps its part; batches of expert matrices split by
expert (FSDP2's dim 0, expert parallelism) are orthogonalised where they live. States of DTensor parameters
are DTensors with the parameter's placements (torch.distributed.checkpoint reshards them).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None

# the quintic Newton-Schulz coefficients of Keller Jordan's Muon (2024; also Moonlight's and torch.optim.Muon's):
# five steps take singular values into about [0.7, 1.2] fast, rather than converging exactly
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def zeropower_via_newtonschulz5(
    G: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=NS_COEFFICIENTS, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Approximate U V^T of G [..., A, B] (batched over leading dims) with the quintic Newton-Schulz
    iteration. Runs in `dtype` (default: bf16 on CUDA, fp32 elsewhere: CPUs have no fast bf16 matmul)."""
    if G.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix, got shape {tuple(G.shape)}")
    a, b, c = coefficients
    dtype = dtype or (torch.bfloat16 if G.is_cuda else torch.float32)
    X = G.to(dtype)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        S = X @ X.mT
        X = a * X + (b * S + c * (S @ S)) @ X
    return X.mT if transposed else X


def muon_scale(shape) -> float:
    """Moonlight's update scale 0.2 * sqrt(max(A, B)) for matrices [..., A, B]."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def _local(t):
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _local_grad(p):
    """p's gradient, the local part laid out as p's: a DTensor gradient placed otherwise than its parameter (a
    tensor-parallel embedding's Replicate gradient of a Shard(0) weight) is redistributed first (for Replicate to
    Shard a local slice)."""
    g = p.grad
    if DTensor is not None and isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return _local(g)


class MuonClip(torch.optim.Optimizer):
    """Muon (hidden matrices) + AdamW (the rest) + optional per-head QK-Clip.

    Args:
        params: a model (split by role, see `role_groups`), or parameters / groups: a group with
            `use_muon=True` gets Muon (2-D matrices or 3-D batches of matrices only), others AdamW.
        lr, weight_decay: shared by both parts (Muon uses the Moonlight scale, so AdamW's values carry over).
        momentum, nesterov, ns_steps: Muon's. adamw_betas, adamw_eps: AdamW's.
        model: with parameter groups, the model they come from: groups without a `use_muon` key are
            split by role. `Trainer(optimizer_cls_and_kwargs=(MuonClip, {"model": model, ...}))`
            hands the model itself over as `params`.
        qk_clip_tau: QK-Clip threshold (needs the model; None: no clipping).
        process_group: the ranks that hold the same parameters (None: the whole world), over which replicated
            matrices' Newton-Schulz work is shared and QK-Clip's maxima are reduced; under pipeline parallelism a
            stage's own data-parallel (and tensor-parallel) ranks (`kimi_hf.distributed.ParallelMesh.replica_group`).
            FSDP2's DTensor parameters use their own mesh.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.1,
        adamw_betas=(0.9, 0.95),
        adamw_eps: float = 1e-8,
        *,
        ns_dtype: torch.dtype | None = None,
        model: nn.Module | None = None,
        qk_clip_tau: float | None = None,
        process_group=None,
    ):
        for name, value, ok in (
            ("lr", lr, lr >= 0),
            ("momentum", momentum, 0 <= momentum < 1),
            ("weight_decay", weight_decay, weight_decay >= 0),
            ("ns_steps", ns_steps, ns_steps >= 1),
            ("adamw_eps", adamw_eps, adamw_eps > 0),
        ):
            if not ok:
                raise ValueError(f"invalid {name}: {value!r}")
        if len(adamw_betas) != 2 or not all(0 <= b < 1 for b in adamw_betas):
            raise ValueError(f"invalid adamw_betas: {adamw_betas!r}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            use_muon=False,
            ns_dtype=ns_dtype,
        )
        if isinstance(params, nn.Module):  # a model (also how Trainer passes `model=` from optimizer kwargs)
            model, params = params, role_groups(params)
        elif model is not None:
            params = _regroup_by_role(params, model)
        super().__init__(params, defaults)
        for i, group in enumerate(self.param_groups):
            if group["use_muon"]:
                for p in group["params"]:
                    if p.ndim not in (2, 3):
                        raise ValueError(
                            f"param_groups[{i}] has use_muon=True but holds a tensor of shape "
                            f"{tuple(p.shape)}: Muon takes matrices [A, B] or batches [E, A, B]"
                        )
        self.qk_clip, self.ns_matrices, self.process_group = None, 0, process_group
        if qk_clip_tau is not None:
            if model is None:
                raise ValueError("qk_clip_tau needs the model (MuonClip(model, ...) or MuonClip.from_model)")
            from .qk_clip import QKClip

            self.qk_clip = QKClip(model, tau=qk_clip_tau, group=process_group)

    @classmethod
    def from_model(
        cls, model: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1, qk_clip_tau: float | None = 100.0, **kwargs
    ) -> "MuonClip":
        """Splits `model`'s trainable parameters by role (see `split_params`; no weight decay on
        vectors: norms, biases, A_log, dt_bias) and attaches QK-Clip to every softmax-attention module
        it knows (tau=None: no clipping)."""
        return cls(model, lr=lr, weight_decay=weight_decay, qk_clip_tau=qk_clip_tau, **kwargs)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("qk_clip", None)
        self.__dict__.setdefault("ns_matrices", 0)
        self.__dict__.setdefault("process_group", None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.ns_matrices = 0
        for group in self.param_groups:
            (self._muon_step if group["use_muon"] else self._adamw_step)(group)
        if self.qk_clip is not None:
            self.qk_clip.clip()
        return loss

    # ---- Muon ------------------------------------------------------------------------------
    def _muon_step(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        updates = []
        for p in params:
            g = _local_grad(p).float()
            state = self.state[p]
            if "momentum_buffer" not in state:  # fp32 whatever the parameter dtype
                state["momentum_buffer"] = _state_like(p, torch.zeros_like(g, dtype=torch.float32))
            buf = _local(state["momentum_buffer"])
            buf.lerp_(g, 1 - mu)
            updates.append(g.lerp(buf, mu) if group["nesterov"] else buf)  # Newton-Schulz never writes its input
        ortho = self._orthogonalize(params, updates, group["ns_steps"], group["ns_dtype"])
        for p, o in zip(params, ortho):
            local = _local(p)
            local.mul_(1 - lr * wd)
            local.add_(o.to(local.dtype), alpha=-lr * muon_scale(p.shape))

    def _orthogonalize(self, params, updates, ns_steps, ns_dtype):
        """Newton-Schulz of every update (local shapes), work split across ranks when distributed.
        Counts the matrices this rank orthogonalised in `self.ns_matrices` (last step). A group may mix DTensor
        parameters (FSDP2, tensor / expert parallelism) and plain ones (the replicated layers of a tensor-parallel
        model)."""
        ns = lambda u: zeropower_via_newtonschulz5(u, ns_steps, dtype=ns_dtype)  # noqa: E731
        sharded = [DTensor is not None and isinstance(p, DTensor) for p in params]
        if any(sharded):
            out = [None] * len(params)
            for i in (i for i, s in enumerate(sharded) if s):
                out[i] = _dtensor_orthogonalize(params[i], updates[i], ns)
            self.ns_matrices += sum(sharded)
            plain = [i for i, s in enumerate(sharded) if not s]
            if plain:
                for i, o in zip(
                    plain,
                    self._orthogonalize([params[i] for i in plain], [updates[i] for i in plain], ns_steps, ns_dtype),
                ):
                    out[i] = o
            return out
        group = self.process_group
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            self.ns_matrices += len(updates)
            return [ns(u) for u in updates]
        # DDP: matrices dealt round-robin; one all-reduce of a flat buffer carries every result
        rank = dist.get_rank(group)
        flat = torch.zeros(sum(u.numel() for u in updates), dtype=torch.float32, device=updates[0].device)
        views, offset = [], 0
        for i, u in enumerate(updates):
            view = flat[offset : offset + u.numel()].view_as(u)
            if i % world == rank:
                view.copy_(ns(u))
            views.append(view)
            offset += u.numel()
        self.ns_matrices += len(range(rank, len(updates), world))
        dist.all_reduce(flat, group=group)  # each element has exactly one non-zero contribution: exact
        return views

    # ---- AdamW -----------------------------------------------------------------------------
    def _adamw_step(self, group):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd, eps = group["lr"], group["weight_decay"], group["adamw_eps"]
        beta1, beta2 = group["adamw_betas"]
        ps, gs, ms, vs = [], [], [], []
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = _state_like(p, torch.zeros_like(_local(p), dtype=torch.float32))
                state["exp_avg_sq"] = _state_like(p, torch.zeros_like(_local(p), dtype=torch.float32))
            state["step"] += 1
            ps.append(_local(p))
            gs.append(_local_grad(p).float())
            ms.append(_local(state["exp_avg"]))
            vs.append(_local(state["exp_avg_sq"]))
        step = int(self.state[params[0]]["step"].item())
        bc1, bc2 = 1 - beta1**step, 1 - beta2**step
        torch._foreach_lerp_(ms, gs, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        upd = torch._foreach_div(ms, denom)
        if wd:
            torch._foreach_mul_(ps, 1 - lr * wd)
        if all(p.dtype == torch.float32 for p in ps):
            torch._foreach_add_(ps, upd, alpha=-lr / bc1)
        else:
            for p, u in zip(ps, upd):
                p.add_(u.to(p.dtype), alpha=-lr / bc1)


def _state_like(p, local: torch.Tensor) -> torch.Tensor:
    """An optimizer state for p from its local part: a DTensor with p's mesh and placements when p is one (so
    that torch.distributed.checkpoint saves every rank's shard and reshards it on load), else `local`."""
    if DTensor is None or not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _whole_experts_locally(p) -> bool:
    """Whether a DTensor batch of expert matrices [E, A, B] is split on the expert dim only, on every mesh dim:
    FSDP2's dim-0 shards, expert parallelism, and both (FSDP2 over the ranks that hold the same experts makes the
    outer one a `_StridedShard` of dim 0, which is not a `Shard` subclass): each rank then holds whole experts."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return p.ndim == 3 and all(
        pl.is_replicate() or (isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0) for pl in p.placements
    )


def _dtensor_orthogonalize(p, update, ns):
    """A DTensor parameter's update (its local part) orthogonalised as the whole matrix would be. A batch of
    expert matrices [E, A, B] split only on the expert dim (`_whole_experts_locally`) holds whole experts locally:
    each is orthogonalised where it lives, no communication (gathering them would hold every expert of the layer on
    every rank: at K3's size 118 GB a layer in fp32). Anything else (FSDP2's rows of a matrix, tensor parallelism's rows or
    columns) is gathered whole (one all-gather), orthogonalised, and this rank's part kept as p's placements cut it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(p.placements)
    if _whole_experts_locally(p):
        return ns(update)
    full = DTensor.from_local(update, p.device_mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
    ortho = ns(full.full_tensor())
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    return ortho[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


# ---- splitting a model's parameters by role -----------------------------------------------------
_ADAMW_NAMES = ("A_log", "dt_bias", "e_score_correction_bias")


def _is_expert_batch(module: nn.Module, p: torch.Tensor) -> bool:
    """A stacked [E, out, in] parameter of an experts module (ours and transformers' MoE experts classes
    hold `num_experts`): E matrices, each orthogonalised on its own. Other 3-D tensors are not batches
    of matrices: conv kernels (KDA's short convs [D, 1, W]), positional tables (the ViT's [H, W, C])."""
    if p.ndim != 3 or isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return False
    return isinstance(getattr(module, "num_experts", None), int) or "Expert" in type(module).__name__


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Trainable parameters split into (Muon, AdamW) by role, not only by ndim.

    Muon: weights of nn.Linear layers inside the network (attention and KDA projections, MLA's low-rank
    chain and output gate, FFNs, shared experts, K3's latent-MoE bridges, the vision tower's and the
    projector's linears) and stacked routed experts ([E, out, in] of an experts module: per expert).
    AdamW: embeddings and the output head (even when they are nn.Linear or tied), norms, biases, KDA's
    A_log / dt_bias, convolution kernels (KDA's short convs, the ViT's patch embedding), positional
    tables, Attention Residual pseudo-queries and their key norms, MoE routers (a gate, not a hidden map),
    and anything else that is not a hidden matrix. Buffers (e.g. the router's e_score_correction_bias)
    are not parameters and are in neither.
    """
    skip = set()
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None:
            skip.update(id(p) for p in module.parameters())
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            skip.update(id(p) for p in module.parameters())
    muon, adamw, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            hidden_linear = isinstance(module, nn.Linear) and name == "weight" and p.ndim == 2
            router = type(module).__name__.endswith("Router") or module_name.endswith(".gate")
            matrix = hidden_linear or _is_expert_batch(module, p)
            if id(p) not in skip and matrix and not router and name not in _ADAMW_NAMES:
                muon.append(p)
            else:
                adamw.append(p)
    return muon, adamw


def role_groups(model: nn.Module) -> list[dict]:
    """Parameter groups of a model by role: Muon matrices; AdamW matrices (embeddings, head,
    routers, convs); AdamW vectors (norms, biases, A_log, dt_bias) without weight decay."""
    muon, adamw = split_params(model)
    groups = [
        {"params": muon, "use_muon": True},
        {"params": [p for p in adamw if p.ndim >= 2], "use_muon": False},
        {"params": [p for p in adamw if p.ndim < 2], "use_muon": False, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _regroup_by_role(params, model: nn.Module):
    """Groups given without `use_muon` (e.g. Trainer's decay / no-decay groups) are split by role,
    keeping each group's other settings."""
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    muon_ids = {id(p) for p in split_params(model)[0]}
    out = []
    for group in groups:
        if "use_muon" in group:
            out.append(group)
            continue
        plist = list(group["params"])
        rest = {k: v for k, v in group.items() if k != "params"}
        muon = [p for p in plist if id(p) in muon_ids]
        other = [p for p in plist if id(p) not in muon_ids]
        out += [dict(rest, params=muon, use_muon=True)] if muon else []
        out += [dict(rest, params=other, use_muon=False)] if other else []
    return out


__all__ = ["MuonClip", "zeropower_via_newtonschulz5", "split_params", "role_groups", "muon_scale", "NS_COEFFICIENTS"]
