"""Checkpoint conversion (streaming, sharded, atomic): Kimi Linear namings, Kimi K2.5's vision
tower, and Kimi K3 folders with their MXFP4 routed experts dequantised (`convert_k3`). Command-line
entry points: `kimi-hf convert` and the repository's conversion/ folder, both through `cli`.

Shared by every converter: `monitor` (peak memory, progress), `output_dir` (the atomic output folder),
`verify` (--verify), `fp32` (the tensors kept in float32).

The names below load on first use (PEP 562): importing the package for its command line stays free of
torch (`kimi-hf convert NAME --help` answers at once)."""

import importlib


_EXPORTS = {
    "CheckpointReader": (".checkpoint", "CheckpointReader"),
    "ShardedWriter": (".checkpoint", "ShardedWriter"),
    "parse_size": ("..sizes", "parse_size"),  # one size convention for the package: kimi_hf.sizes
    "peak_rss_mb": (".monitor", "peak_rss_mb"),
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
