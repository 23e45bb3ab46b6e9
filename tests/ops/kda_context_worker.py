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
# packed rows (document offsets in a row of 64 tokens): a document over ranks 0-2 (rank 1 wholly inside it: its state
# map passes through), a one-token document, one over ranks 2-3; a second row with documents starting on the rank
# boundaries 16 and 48 and one over ranks 1-2
PACKED = ([0, 5, 40, 41, 49, 64], [0, 16, 20, 48, 64])
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


def flat_offsets(rows, T: int) -> torch.Tensor:
    """The rows' document offsets (each over T tokens) as cu_seqlens of the rows flattened into one."""
    return torch.tensor(sorted({r * T + c for r, cu in enumerate(rows) for c in cu}))


def local_layout(rows, rank: int):
    """This rank's part of the packed rows, over [rank T_LOCAL, (rank + 1) T_LOCAL) of each: (cu_seqlens of the rows'
    slices flattened, whether each row's first document continues, each row's first and last document index)."""
    lo, hi = rank * T_LOCAL, (rank + 1) * T_LOCAL
    cuts = [sorted({0, T_LOCAL, *(c - lo for c in cu if lo < c < hi)}) for cu in rows]
    counts = torch.tensor([len(c) - 1 for c in cuts])
    last = counts.cumsum(0) - 1
    return flat_offsets(cuts, T_LOCAL), torch.tensor([lo not in cu for cu in rows]), last - counts + 1, last


def case(name: str, gates: dict, packed: bool, group) -> dict:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    T = T_LOCAL * size
    B = 2
    gen = torch.Generator().manual_seed(3)
    inputs, A_log, dt_bias = tensors(B, T, gen)
    if packed:  # the rows' documents as one flattened row (chunk_kda's varlen convention)
        inputs = [x.reshape(1, B * T, *x.shape[2:]) for x in inputs]
    dout = torch.randn(*inputs[2].shape, generator=gen, dtype=torch.float64)
    # the reference: the token loop over the whole sequences
    full = [x.clone().requires_grad_() for x in (*inputs, A_log, dt_bias)]
    cu = flat_offsets(PACKED, T) if packed else None
    ref, _ = chunk_kda(*full[:5], cu_seqlens=cu, backend="reference", A_log=full[5], dt_bias=full[6], **gates)
    ref.backward(dout)

    # this rank's slice of each row
    def mine_of(x):
        rows = x.reshape(B, T, *x.shape[2:])[:, rank * T_LOCAL : (rank + 1) * T_LOCAL]
        return rows.reshape(1, B * T_LOCAL, *x.shape[2:]) if packed else rows

    mine = [mine_of(x).clone().requires_grad_() for x in inputs]
    params = [x.clone().requires_grad_() for x in (A_log, dt_bias)]  # shared: each rank's gradient is a partial sum
    kw = dict(group=group, continues=torch.tensor([rank > 0] * B))
    if packed:
        local_cu, cont, first, last = local_layout(PACKED, rank)
        kw.update(continues=cont, cu_seqlens=local_cu, first_seq=first, last_seq=last)
    out = chunk_kda_context_parallel(*mine, backend="torch", A_log=params[0], dt_bias=params[1], **kw, **gates)
    out.backward(mine_of(dout))
    diffs = {"o": (out - mine_of(ref)).abs().max().item()}
    for label, a, b in zip(("q", "k", "v", "g", "beta"), mine, full):
        diffs[label] = (a.grad - mine_of(b.grad)).abs().max().item()
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
