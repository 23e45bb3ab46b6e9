"""Checkpoint conversion (streaming, sharded, atomic): Kimi Linear namings and Kimi K2.5's vision
tower. Command-line entry points live in the repository's conversion/ folder and `kimi-hf convert`."""

from .checkpoint import CheckpointReader, ShardedWriter, parse_size, peak_rss_mb
from .kimi_linear import convert as convert_kimi_linear
from .kimi_linear import verify as verify_kimi_linear
from .tokenizer import convert_tokenizer_dir, tiktoken_to_fast

__all__ = ["CheckpointReader", "ShardedWriter", "parse_size", "peak_rss_mb", "convert_kimi_linear", "verify_kimi_linear",
           "tiktoken_to_fast", "convert_tokenizer_dir"]
