"""Triton KDA kernels: the fused recurrent (decode) forward. The chunked forward/backward kernels
are the next step; until then kimi_hf's dispatcher runs chunk_kda's PyTorch path on every device."""

from .recurrent import recurrent_kda

__all__ = ["recurrent_kda"]
