"""Triton kernels for Kimi K3's routed experts kept in MXFP4 (kimi_hf.ops.mxfp4_matmul): the grouped expert matmul
with weights decoded in registers, forward and input gradient. CUDA; CPU only under TRITON_INTERPRET=1."""

from .grouped_matmul import mxfp4_grouped_matmul


__all__ = ["mxfp4_grouped_matmul"]
