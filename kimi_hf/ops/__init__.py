"""Stable public home of the operators: `from kimi_hf.ops import chunk_kda, recurrent_kda, depth_attention`."""

from .depth_attention import depth_attention, depth_attention_weights
from .kda import chunk_kda, l2norm, naive_recurrent_kda, recurrent_kda


__all__ = ["chunk_kda", "recurrent_kda", "naive_recurrent_kda", "l2norm", "depth_attention", "depth_attention_weights"]
