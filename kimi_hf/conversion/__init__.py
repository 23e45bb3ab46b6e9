"""Checkpoint conversion (streaming, sharded, atomic): Kimi Linear namings, Kimi K2.5's vision
tower, and Kimi K3 folders with their MXFP4 routed experts dequantised (`convert_k3`). Command-line
entry points live in the repository's conversion/ folder and `kimi-hf convert`.

The names below load on first use (PEP 562): importing the package for its command line stays free of
torch (`kimi-hf convert NAME --help` answers at once)."""

import importlib


_EXPORTS = {
    "CheckpointReader": (".checkpoint", "CheckpointReader"),
    "ShardedWriter": (".checkpoint", "ShardedWriter"),
    "parse_size": (".safetensors_stream", "parse_size"),
    "peak_rss_mb": (".checkpoint", "peak_rss_mb"),
    "convert_kimi_linear": (".kimi_linear", "convert"),
    "verify_kimi_linear": (".kimi_linear", "verify"),
    "convert_k3": (".k3", "convert_k3"),
    "plan_k3": (".k3", "plan_k3"),
    "verify_k3": (".k3", "verify_k3"),
    "tiktoken_to_fast": (".tokenizer", "tiktoken_to_fast"),
    "convert_tokenizer_dir": (".tokenizer", "convert_tokenizer_dir"),
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module, __name__), attr)
