"""The hybrid cache: transformers' v5 Cache with one layer kind per mixer.

- MLA layers ("full_attention") keep the compressed latent: per token kv_lora_rank normalised latent
  values plus qk_rope_head_dim shared key values (a `DynamicLayer` whose keys/values are those two
  single-head tensors), expanded by kv_b_proj at every step.
- KDA layers ("linear_attention") keep the last (kernel - 1) inputs of the q/k/v short convolutions
  and the fp32 recurrent state [B, H, K, V]: constant in the sequence length. A recurrent state
  cannot be cropped or rewound (transformers refuses `crop` on such layers).
"""

import torch
from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin


class KimiHybridCache(DynamicCache):
    """`DynamicCache(config=...)` for the hybrid model, plus a memory report."""

    def __init__(self, config, **kwargs):
        super().__init__(config=config, **kwargs)

    def nbytes(self) -> int:
        """Bytes held by all cached tensors (latents, conv inputs, recurrent states)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                tensors = [*layer.conv_states.values(), *layer.recurrent_states.values()]
            else:
                tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
            total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        return total


__all__ = ["KimiHybridCache"]
