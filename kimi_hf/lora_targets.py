"""The PEFT LoRA targets the package recommends for a model, by its config: one public way to get them
(`kimi_hf.lora_target_modules(config)`), used by the planner, the examples and the trainers.

- Kimi K3 (`kimi_k3`, `kimi_k3_text`): `K3_LORA_TARGET_MODULES` (modeling_kimi_k3: the attention and MLP
  projections, q LoRA, and the latent MoE's bridges into the stacked routed experts);
- the Kimi Linear layout (`kimi_hybrid`, `kimi_hybrid_text`): `LORA_TARGET_MODULES` (modeling_kimi_hybrid).
"""

from __future__ import annotations

from collections.abc import Mapping


def _model_type(config) -> str | None:
    if isinstance(config, Mapping):
        return config.get("model_type")
    config = getattr(config, "config", config)  # a model (or a PEFT model's base) gives its config
    return getattr(config, "model_type", None)


def lora_target_modules(config) -> list[str]:
    """The recommended `LoraConfig(target_modules=...)` for a model of `config` (a config object, a model, or a
    config.json dict). Raises ValueError naming the model_type for a model that is not one of this package's."""
    model_type = _model_type(config)
    if model_type in ("kimi_k3", "kimi_k3_text"):
        from .models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES

        return list(K3_LORA_TARGET_MODULES)
    if model_type in ("kimi_hybrid", "kimi_hybrid_text"):
        from .models.kimi_hybrid.modeling_kimi_hybrid import LORA_TARGET_MODULES

        return list(LORA_TARGET_MODULES)
    raise ValueError(
        f"config: model_type {model_type!r} is not a generation model of kimi_hf (kimi_k3, kimi_k3_text, kimi_hybrid, "
        "kimi_hybrid_text): no recommended LoRA targets"
    )


# lora_alpha = LORA_ALPHA_PER_RANK x r: the adapters' scaling (alpha / r) is 2 at every rank, which the exporters
# that merge a trained adapter take as given (kimi_hf.distributed.export.export_lora's `scaling`)
LORA_ALPHA_PER_RANK = 2


def lora_config(config, rank: int = 16, target_modules=None):
    """The package's `peft.LoraConfig` for a model of `config`: rank r, lora_alpha 2 r, no dropout (the same
    adapters and the same step on every layout), `target_modules` default `lora_target_modules(config)`."""
    from peft import LoraConfig

    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"--lora-rank must be a positive integer, got {rank!r}")
    targets = lora_target_modules(config) if target_modules is None else target_modules
    return LoraConfig(r=rank, lora_alpha=LORA_ALPHA_PER_RANK * rank, lora_dropout=0.0, target_modules=targets)


__all__ = ["LORA_ALPHA_PER_RANK", "lora_config", "lora_target_modules"]
