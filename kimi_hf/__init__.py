"""kimi_hf: the techniques behind Moonshot AI's Kimi K2.5 for the Hugging Face ecosystem.

    kimi_hf.ops.chunk_kda / recurrent_kda          Kimi Delta Attention (training/prefill, decoding)
    kimi_hf.KimiHybridTextConfig, KimiHybridTextModel, KimiHybridForCausalLM
                                                   the hybrid KDA/MLA/MoE decoder (Kimi Linear layout)
    kimi_hf.KimiHybridConfig, KimiHybridModel, KimiHybridForConditionalGeneration,
    KimiHybridVisionConfig, KimiHybridVisionModel, KimiHybridImageProcessor, KimiHybridProcessor
                                                   early fusion: MoonViT tower + hybrid decoder
    kimi_hf.KimiK3Config, KimiK3Model, KimiK3ForConditionalGeneration, KimiK3TextConfig, KimiK3TextModel,
    KimiK3ForCausalLM, KimiK3VisionConfig, KimiK3VisionModel, KimiK3ImageProcessor, KimiK3Processor
                                                   Kimi K3 as released (loads Moonshot's folders directly)

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
    "K3_LORA_TARGET_MODULES",
    "lora_target_modules",
    "lora_config",
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
    "KimiK3Config",
    "KimiK3TextConfig",
    "KimiK3VisionConfig",
    "KimiK3VisionModel",
    "KimiK3TextModel",
    "KimiK3ForCausalLM",
    "KimiK3Model",
    "KimiK3ForConditionalGeneration",
    "KimiK3ImageProcessor",
    "KimiK3Processor",
    "__version__",
]


def _register() -> None:
    """Imports the models into this module and registers them with transformers' Auto classes, from the one
    table (`hub_kimi.AUTO_MAPS`) that saved folders' auto_map entries also come from."""
    import importlib

    import transformers

    from . import ops
    from .lora_targets import lora_config, lora_target_modules
    from .models import hub_kimi
    from .models.kimi_hybrid.cache_kimi_hybrid import KimiHybridCache
    from .models.kimi_hybrid.modeling_kimi_hybrid import LORA_TARGET_MODULES, KimiHybridPreTrainedModel
    from .models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES

    models = hub_kimi.__name__.rpartition(".")[0]
    found = {
        "ops": ops,
        "KimiHybridCache": KimiHybridCache,
        "LORA_TARGET_MODULES": LORA_TARGET_MODULES,
        "K3_LORA_TARGET_MODULES": K3_LORA_TARGET_MODULES,
        "lora_target_modules": lora_target_modules,
        "lora_config": lora_config,
        "KimiHybridPreTrainedModel": KimiHybridPreTrainedModel,
    }
    for entries in hub_kimi.AUTO_MAPS.values():
        classes = {}
        for auto, ref in entries.items():
            module, _, name = ref.partition(".")
            folder = _os.path.basename(_os.path.dirname(hub_kimi.module_file(module)))  # kimi_hybrid, kimi_k3
            classes[auto] = found[name] = getattr(importlib.import_module(f"{models}.{folder}.{module}"), name)
        config = classes.pop("AutoConfig")
        transformers.AutoConfig.register(config.model_type, config, exist_ok=True)
        for auto, cls in classes.items():
            if auto == "AutoImageProcessor":
                transformers.AutoImageProcessor.register(config, image_processor_classes={"pil": cls}, exist_ok=True)
            else:
                getattr(transformers, auto).register(config, cls, exist_ok=True)
            if auto in hub_kimi.PROCESSOR_AUTO_CLASSES:
                cls.register_for_auto_class(auto)  # saved processors carry auto_map and their code file
    globals().update({name: found[name] for name in __all__ if name in found})


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
