"""kimi_hf.lora_target_modules(config): the one public way to the recommended LoRA targets of a model."""

import pytest

import kimi_hf
from kimi_hf import KimiHybridTextConfig, KimiK3Config, lora_target_modules
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import LORA_TARGET_MODULES
from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES

from .models.kimi_k3.release_format import tiny_k3_config


def test_k3_and_kimi_linear_targets_by_config_model_or_dict():
    k3 = KimiK3Config(**tiny_k3_config())
    assert lora_target_modules(k3) == K3_LORA_TARGET_MODULES == kimi_hf.K3_LORA_TARGET_MODULES
    assert lora_target_modules(k3.text_config) == K3_LORA_TARGET_MODULES
    assert lora_target_modules(tiny_k3_config()) == K3_LORA_TARGET_MODULES  # a config.json dict
    assert "routed_expert_down_proj" in lora_target_modules(k3)  # the latent MoE's bridges
    linear = KimiHybridTextConfig(num_hidden_layers=2)
    assert lora_target_modules(linear) == LORA_TARGET_MODULES == kimi_hf.LORA_TARGET_MODULES
    targets = lora_target_modules(linear)
    targets.append("x")  # a copy: the package's list is not changed through it
    assert "x" not in LORA_TARGET_MODULES


def test_another_architecture_is_refused_by_name():
    with pytest.raises(ValueError, match="model_type 'llama'"):
        lora_target_modules({"model_type": "llama"})
