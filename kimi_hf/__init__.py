"""kimi_hf: the techniques behind Moonshot AI's Kimi K2.5 for the Hugging Face ecosystem.

Public entry points so far:
    kimi_hf.ops.chunk_kda / recurrent_kda   Kimi Delta Attention (training/prefill, decoding)
"""

__version__ = "0.1.0"

from . import ops  # noqa: E402

__all__ = ["ops", "__version__"]
