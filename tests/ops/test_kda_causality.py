"""Causality of chunk_kda's PyTorch path with Kimi K3's safe gate (lower_bound set, the gate fused): what comes at
or after a position t (gates, keys, values, betas, queries) changes neither an output before t nor any gradient of a
loss on the outputs before t, with t inside a chunk and at a chunk edge (flash-linear-attention's safe-gate fast path
has broken this). Tolerance: none, bit for bit in fp32 (every output and gradient before t; 0 after it).
The Triton kernels' twin: tests/kernels/kda/test_causality.py."""

import pytest

from kimi_hf.ops.kda import CHUNK_SIZE

from .kda_helpers import assert_causal_prefix, safe_gate_inputs


T = CHUNK_SIZE + 16  # two chunks, the second partial


@pytest.mark.parametrize("cut", [37, CHUNK_SIZE, CHUNK_SIZE + 6], ids=["in-chunk-1", "chunk-edge", "in-chunk-2"])
def test_safe_gate_outputs_and_gradients_before_t_ignore_everything_from_t_on(cut):
    assert_causal_prefix(list(safe_gate_inputs(T, 2, 16, 16, 1, seed=cut)), cut, backend="torch")
