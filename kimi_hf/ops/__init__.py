"""Stable public home of the operators: `from kimi_hf.ops import chunk_kda, recurrent_kda, depth_attention`,
`linear_cross_entropy` / `chunked_causal_lm_loss` (the language-model head and its loss in chunks of tokens).

KDA and the MXFP4 ops load lazily (PEP 562): importing one op module (e.g. `kimi_hf.ops.mxfp4`, the MXFP4 codec that
the converters use) does not import the others, nor the Triton kernels behind KDA.
"""

import importlib

# eager: torch only, and the function's name is its module's (a lazy attribute would return the module once the
# submodule is imported)
from .depth_attention import depth_attention, depth_attention_weights


_EXPORTS = {
    "chunk_kda": "kda",
    "recurrent_kda": "kda",
    "naive_recurrent_kda": "kda",
    "l2norm": "kda",
    "dequantize_mxfp4": "mxfp4",
    "quantize_mxfp4": "mxfp4",
    "mxfp4_grouped_linear": "mxfp4_matmul",
    "linear_cross_entropy": "chunked_cross_entropy",
    "chunked_causal_lm_loss": "chunked_cross_entropy",
}
__all__ = ["depth_attention", "depth_attention_weights", *_EXPORTS]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
