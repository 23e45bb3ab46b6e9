"""Run by test_kda_context.py under torchrun (gloo, CPU, 4 ranks): `chunk_kda_context_parallel` on this rank's
slice of fp64 sequences, against the token loop (`chunk_kda(backend="reference")`) over the whole sequences, which
every rank runs itself; writes the largest differences of the outputs and of every input's gradient.

    python -m torch.distributed.run --nproc_per_node 4 kda_context_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from kimi_hf.ops.kda import chunk_kda
from kimi_hf.ops.kda_context import chunk_kda_context_parallel


T_LOCAL, H, K, V = 16, 2, 8, 6
# packed: a document over ranks 0-2 (rank 1 wholly inside it: its state map passes through), a one-token document,
# one over ranks 2-3, and a start on the rank 3 boundary's other side
PACKED = [0, 5, 40, 41, 49, 64]
GATES = {
    "kimi_linear": dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm=True),
    "k3_safe_gate": dict(
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm=True, safe_gate=True, lower_bound=-5.0
    ),
}


def tensors(B: int, T: int, gen):
    q, k, f = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    A_log = torch.rand(H, generator=gen, dtype=torch.float64).add(0.5).log()
    dt_bias = 0.1 * torch.randn(H * K, generator=gen, dtype=torch.float64)
    return [q, k, v, f, beta], A_log, dt_bias


def local_layout(cu: list[int], rank: int):
    """This rank's cu_seqlens, whether its first document continues, over [rank T_LOCAL, (rank + 1) T_LOCAL)."""
    lo, hi = rank * T_LOCAL, (rank + 1) * T_LOCAL
    cuts = sorted({0, T_LOCAL, *(c - lo for c in cu if lo < c < hi)})
    return torch.tensor(cuts), lo not in cu


def case(name: str, gates: dict, packed: bool, group) -> dict:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    T = T_LOCAL * size
    B = 1 if packed else 2
    gen = torch.Generator().manual_seed(3)
    inputs, A_log, dt_bias = tensors(B, T, gen)
    dout = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    # the reference: the token loop over the whole sequences
    full = [x.clone().requires_grad_() for x in (*inputs, A_log, dt_bias)]
    cu = torch.tensor(PACKED) if packed else None
    ref, _ = chunk_kda(*full[:5], cu_seqlens=cu, backend="reference", A_log=full[5], dt_bias=full[6], **gates)
    ref.backward(dout)
    # this rank's slice
    sl = slice(rank * T_LOCAL, (rank + 1) * T_LOCAL)
    mine = [x[:, sl].clone().requires_grad_() for x in inputs]
    params = [x.clone().requires_grad_() for x in (A_log, dt_bias)]  # shared: each rank's gradient is a partial sum
    kw = dict(group=group, continues=torch.tensor([rank > 0] * B))
    if packed:
        local_cu, cont = local_layout(PACKED, rank)
        n = local_cu.numel() - 1
        kw.update(continues=torch.tensor([cont]), cu_seqlens=local_cu, first_seq=torch.tensor([0]))
        kw.update(last_seq=torch.tensor([n - 1]))
    out = chunk_kda_context_parallel(*mine, backend="torch", A_log=params[0], dt_bias=params[1], **kw, **gates)
    out.backward(dout[:, sl])
    diffs = {"o": (out - ref[:, sl]).abs().max().item()}
    for label, a, b in zip(("q", "k", "v", "g", "beta"), mine, full):
        diffs[label] = (a.grad - b.grad[:, sl]).abs().max().item()
    for label, a, b in zip(("A_log", "dt_bias"), params, full[5:]):
        dist.all_reduce(a.grad, group=group)
        diffs[label] = (a.grad - b.grad).abs().max().item()
    diffs["scale"] = ref.abs().max().item()
    return diffs


def main():
    dist.init_process_group("gloo")
    out = {}
    for gate_name, gates in GATES.items():
        for packed in (False, True):
            name = f"{gate_name}_{'packed' if packed else 'rows'}"
            out[name] = case(name, gates, packed, None)
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
