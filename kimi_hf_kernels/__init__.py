"""kimi_hf_kernels: Triton kernels behind kimi_hf.ops (CUDA; CPU only under TRITON_INTERPRET=1).

The folder is named as it installs: a top-level `kernels` folder would shadow Hugging Face's `kernels` package
(which transformers >= 5.25 imports at start-up) wherever the repository's root is on sys.path.
"""
