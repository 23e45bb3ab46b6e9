"""Stable public home of the operators: `from kimi_hf.ops import chunk_kda, recurrent_kda`."""

from ..models.kimi_hybrid.kda import chunk_kda, l2norm, naive_recurrent_kda, recurrent_kda

__all__ = ["chunk_kda", "recurrent_kda", "naive_recurrent_kda", "l2norm"]
