"""kimi_hf: the techniques behind Moonshot AI's Kimi K2.5 for the Hugging Face ecosystem.

    kimi_hf.ops.chunk_kda / recurrent_kda          Kimi Delta Attention (training/prefill, decoding)
    kimi_hf.KimiHybridTextConfig, KimiHybridTextModel, KimiHybridForCausalLM
                                                   the hybrid KDA/MLA/MoE decoder (Kimi Linear layout)

Importing kimi_hf registers the models with transformers' Auto classes.
"""

__version__ = "0.1.0"

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import ops
from .models.kimi_hybrid.cache_kimi_hybrid import KimiHybridCache
from .models.kimi_hybrid.configuration_kimi_hybrid import KimiHybridTextConfig
from .models.kimi_hybrid.modeling_kimi_hybrid import (
    LORA_TARGET_MODULES,
    KimiHybridForCausalLM,
    KimiHybridPreTrainedModel,
    KimiHybridTextModel,
)

AutoConfig.register(KimiHybridTextConfig.model_type, KimiHybridTextConfig, exist_ok=True)
AutoModel.register(KimiHybridTextConfig, KimiHybridTextModel, exist_ok=True)
AutoModelForCausalLM.register(KimiHybridTextConfig, KimiHybridForCausalLM, exist_ok=True)

__all__ = [
    "ops",
    "LORA_TARGET_MODULES",
    "KimiHybridCache",
    "KimiHybridTextConfig",
    "KimiHybridPreTrainedModel",
    "KimiHybridTextModel",
    "KimiHybridForCausalLM",
    "__version__",
]
