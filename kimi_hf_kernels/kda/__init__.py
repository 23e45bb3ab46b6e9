"""Triton KDA kernels behind kimi_hf.ops: the chunked forward/backward (training, prefill) and the
fused recurrent forward (decoding). CUDA; CPU only under TRITON_INTERPRET=1."""

from .chunk import chunk_kda
from .recurrent import recurrent_kda


__all__ = ["chunk_kda", "recurrent_kda"]
