"""kimi_hf: the techniques behind Moonshot AI's Kimi K2.5 for the Hugging Face ecosystem.

    kimi_hf.ops.chunk_kda / recurrent_kda          Kimi Delta Attention (training/prefill, decoding)
    kimi_hf.KimiHybridTextConfig, KimiHybridTextModel, KimiHybridForCausalLM
                                                   the hybrid KDA/MLA/MoE decoder (Kimi Linear layout)
    kimi_hf.KimiHybridConfig, KimiHybridModel, KimiHybridForConditionalGeneration,
    KimiHybridVisionConfig, KimiHybridVisionModel, KimiHybridImageProcessor, KimiHybridProcessor
                                                   early fusion: MoonViT tower + hybrid decoder

Importing kimi_hf registers the models with transformers' Auto classes. The one exception is the
`kimi-hf` command's own process (console script or `python -m kimi_hf`): there the models are imported
and registered on first use of any of the names above, so that `kimi-hf --help` and usage errors do not
pay for importing torch and transformers' modeling code (seconds).
"""

__version__ = "0.1.0"

import os as _os
import sys as _sys

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

def _register() -> None:
    """Imports the models into this module and registers them with transformers' Auto classes."""
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
    from .models.kimi_hybrid.configuration_kimi_hybrid import (
        KimiHybridConfig,
        KimiHybridTextConfig,
        KimiHybridVisionConfig,
    )
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

    for config in (KimiHybridTextConfig, KimiHybridVisionConfig, KimiHybridConfig):
        AutoConfig.register(config.model_type, config, exist_ok=True)
    AutoModel.register(KimiHybridTextConfig, KimiHybridTextModel, exist_ok=True)
    AutoModelForCausalLM.register(KimiHybridTextConfig, KimiHybridForCausalLM, exist_ok=True)
    AutoModel.register(KimiHybridVisionConfig, KimiHybridVisionModel, exist_ok=True)
    AutoModel.register(KimiHybridConfig, KimiHybridModel, exist_ok=True)
    AutoModelForImageTextToText.register(KimiHybridConfig, KimiHybridForConditionalGeneration, exist_ok=True)
    AutoModelForCausalLM.register(KimiHybridConfig, KimiHybridForConditionalGeneration, exist_ok=True)
    AutoImageProcessor.register(KimiHybridConfig, image_processor_classes={"pil": KimiHybridImageProcessor},
                                exist_ok=True)
    AutoProcessor.register(KimiHybridConfig, KimiHybridProcessor, exist_ok=True)
    names = locals()
    globals().update({name: names[name] for name in __all__ if name in names})


def _started_as_the_cli() -> bool:
    """True while the `kimi-hf` console script or `python -m kimi_hf` imports this package."""
    script = _os.path.basename(_sys.argv[0]) if _sys.argv else ""
    if script.removesuffix(".exe").removesuffix("-script.py") == "kimi-hf":
        return True
    # under -m, sys.argv[0] is "-m" while the package is imported; the module name is in orig_argv
    argv = getattr(_sys, "orig_argv", [])
    return script == "-m" and "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == ["kimi_hf"]


if _started_as_the_cli():
    _registering = False

    def __getattr__(name: str):
        global _registering

        if name == "ops":  # a subpackage: importing it registers nothing (and `from . import ops` lands here)
            import importlib

            return importlib.import_module(".ops", __name__)
        if name in __all__ and not _registering:  # re-entry: a circular import, which fails as it would eagerly
            _registering = True
            try:
                _register()
            finally:
                _registering = False
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

else:
    _register()
