"""Causality of the Triton chunk kernels (kimi_hf_kernels.kda, under TRITON_INTERPRET=1 on CPU) with Kimi K3's safe
gate fused (lower_bound, A_log, dt_bias): what comes at or after a position t (gates, keys, values, betas, queries)
changes neither an output before t nor any gradient of a loss on the outputs before t, with t inside a chunk (both
chunks) and at a chunk edge; flash-linear-attention's safe-gate fast path has broken this. Tolerance: none, bit for
bit in fp32 (every output and gradient before t; 0 after it). Small: one head, head dim 16, two chunks.
The PyTorch path's twin: tests/ops/test_kda_causality.py."""

import os

import pytest

from kimi_hf_kernels.kda.common import CHUNK

from ...ops.kda_helpers import assert_causal_prefix, safe_gate_inputs


pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

T = CHUNK + 16  # two chunks, the second partial


@pytest.mark.parametrize("cut", [37, CHUNK, CHUNK + 6], ids=["in-chunk-1", "chunk-edge", "in-chunk-2"])
def test_safe_gate_outputs_and_gradients_before_t_ignore_everything_from_t_on(cut):
    assert_causal_prefix(list(safe_gate_inputs(T, 1, 16, 16, 1, seed=cut)), cut, backend="triton")
