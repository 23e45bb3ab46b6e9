"""`chunk_kda_context_parallel` (kimi_hf.ops.kda_context): on 4 gloo ranks, in fp64, the outputs and the gradients of
every input (q, k, v, the raw forget input, beta logits, A_log and dt_bias) equal the token loop over the whole
sequences to 1e-12: rows split over the ranks, and two packed rows of documents crossing boundaries (one over three
ranks, a middle rank wholly inside it; documents starting on a boundary), Kimi Linear's gate and K3's safe gate. The state fold on its own against the
recurrence written out."""

from __future__ import annotations

import json

import pytest
import torch

from kimi_hf.ops.kda_context import chunk_kda_context_parallel, fold_incoming_states
from tests.distributed.launch import ROOT, torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("kda_cp")
    torchrun(ROOT / "tests" / "ops" / "kda_context_worker.py", [str(out)], nproc=4)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize(
    "case", ["kimi_linear_rows", "kimi_linear_packed", "k3_safe_gate_rows", "k3_safe_gate_packed"]
)
def test_cp4_equals_the_token_loop(results, case):
    for rank, per_rank in enumerate(results):
        diffs = per_rank[case]
        assert diffs["scale"] > 0.1  # outputs of a size where 1e-12 means something
        worst = {k: v for k, v in diffs.items() if k != "scale" and v > 1e-12}
        assert not worst, (case, rank, worst)


def test_fold_is_the_recurrence_of_the_state_maps():
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(4, 2, 3, 5, 5, generator=gen, dtype=torch.float64)
    b = torch.randn(4, 2, 3, 5, 7, generator=gen, dtype=torch.float64)
    assert fold_incoming_states(A, b, 0) is None
    torch.testing.assert_close(fold_incoming_states(A, b, 1), b[0])
    want = A[2] @ (A[1] @ b[0] + b[1]) + b[2]
    torch.testing.assert_close(fold_incoming_states(A, b, 3), want)


def test_refuses_states_of_its_own():
    x = torch.zeros(1, 4, 1, 2)
    with pytest.raises(ValueError, match="no initial_state / output_final_state"):
        chunk_kda_context_parallel(x, x, x, x, x[..., 0], group=None, continues=torch.tensor([False]), initial_state=x)
