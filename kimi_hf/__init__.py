"""kimi_hf: the techniques behind Moonshot AI's Kimi K2.5 for the Hugging Face ecosystem.

    kimi_hf.ops.chunk_kda / recurrent_kda          Kimi Delta Attention (training/prefill, decoding)
    kimi_hf.KimiHybridTextConfig, KimiHybridTextModel, KimiHybridForCausalLM
                                                   the hybrid KDA/MLA/MoE decoder (Kimi Linear layout)
    kimi_hf.KimiHybridConfig, KimiHybridModel, KimiHybridForConditionalGeneration,
    KimiHybridVisionConfig, KimiHybridVisionModel, KimiHybridImageProcessor, KimiHybridProcessor
                                                   early fusion: MoonViT tower + hybrid decoder

Importing kimi_hf registers the models with transformers' Auto classes.
"""

__version__ = "0.1.0"

from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
)

from . import ops
from .models.kimi_hybrid.cache_kimi_hybrid import KimiHybridCache
from .models.kimi_hybrid.configuration_kimi_hybrid import KimiHybridConfig, KimiHybridTextConfig, KimiHybridVisionConfig
from .models.kimi_hybrid.image_processing_kimi_hybrid import KimiHybridImageProcessor
from .models.kimi_hybrid.modeling_kimi_hybrid import (
    LORA_TARGET_MODULES,
    KimiHybridForCausalLM,
    KimiHybridPreTrainedModel,
    KimiHybridTextModel,
)
from .models.kimi_hybrid.modeling_kimi_hybrid_multimodal import KimiHybridForConditionalGeneration, KimiHybridModel
from .models.kimi_hybrid.modeling_kimi_hybrid_vision import KimiHybridVisionModel
from .models.kimi_hybrid.processing_kimi_hybrid import KimiHybridProcessor

for _config in (KimiHybridTextConfig, KimiHybridVisionConfig, KimiHybridConfig):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
AutoModel.register(KimiHybridTextConfig, KimiHybridTextModel, exist_ok=True)
AutoModelForCausalLM.register(KimiHybridTextConfig, KimiHybridForCausalLM, exist_ok=True)
AutoModel.register(KimiHybridVisionConfig, KimiHybridVisionModel, exist_ok=True)
AutoModel.register(KimiHybridConfig, KimiHybridModel, exist_ok=True)
AutoModelForImageTextToText.register(KimiHybridConfig, KimiHybridForConditionalGeneration, exist_ok=True)
AutoModelForCausalLM.register(KimiHybridConfig, KimiHybridForConditionalGeneration, exist_ok=True)
AutoImageProcessor.register(KimiHybridConfig, image_processor_classes={"pil": KimiHybridImageProcessor}, exist_ok=True)
AutoProcessor.register(KimiHybridConfig, KimiHybridProcessor, exist_ok=True)

__all__ = [
    "ops",
    "LORA_TARGET_MODULES",
    "KimiHybridCache",
    "KimiHybridTextConfig",
    "KimiHybridPreTrainedModel",
    "KimiHybridTextModel",
    "KimiHybridForCausalLM",
    "KimiHybridVisionConfig",
    "KimiHybridVisionModel",
    "KimiHybridConfig",
    "KimiHybridModel",
    "KimiHybridForConditionalGeneration",
    "KimiHybridImageProcessor",
    "KimiHybridProcessor",
    "__version__",
]
