"""The MX block size, the package's one statement of it: OCP Microscaling (MX v1.0) formats share one E8M0 scale
among MX_BLOCK consecutive elements of a row, so an MXFP4 weight [out, in] is packed [out, in / 2] uint8 and scaled
[out, in / MX_BLOCK] uint8, and a split of its input dimension (tensor parallelism) must keep whole blocks.

Standard library only (no torch): the torch-free converter plan and layout checks read it too."""

MX_BLOCK = 32  # elements per E8M0 scale (compressed-tensors' group_size for mxfp4-pack-quantized)

__all__ = ["MX_BLOCK"]
