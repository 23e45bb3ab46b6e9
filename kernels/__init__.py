"""kimi_hf_kernels: Triton kernels behind kimi_hf.ops (CUDA; CPU only under TRITON_INTERPRET=1).

Installed from the repository's top-level `kernels/` folder under this name, never as a top-level
`kernels` module (that name belongs to Hugging Face's `kernels` package, which transformers imports).
"""
