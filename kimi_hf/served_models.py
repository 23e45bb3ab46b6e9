"""The models `kimi-hf serve` serves, read off the package's one Auto-class table (`hub_kimi.AUTO_MAPS`): shared by
the command (kimi_hf.serving, which checks a folder before the server starts) and what it installs in transformers'
server (kimi_hf.serving_transformers, imported in each spawned model process too)."""

from __future__ import annotations


GENERATION_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText")  # what transformers serve runs


def served_model_types() -> dict[str, dict[str, str]]:
    """model_type -> its AUTO_MAPS entries, for the model types with a generation class (AutoModelForCausalLM):
    the ones `kimi-hf serve` serves; those with AutoModelForImageTextToText too are image-text models. Read off
    the package's one Auto-class table (hub_kimi imports only the standard library: no torch here)."""
    from .models.hub_kimi import AUTO_MAPS

    return {model_type: entries for model_type, entries in AUTO_MAPS.items() if "AutoModelForCausalLM" in entries}


def served_model_classes() -> dict[type, bool]:
    """The generation classes of `served_model_types()` -> whether they are image-text models: the package's
    own names for them (getting one from kimi_hf registers the Auto classes, in `kimi-hf`'s process too)."""
    import kimi_hf

    classes: dict[type, bool] = {}
    for entries in served_model_types().values():
        multimodal = "AutoModelForImageTextToText" in entries
        for auto in GENERATION_AUTO_CLASSES:
            if auto in entries:
                cls = getattr(kimi_hf, entries[auto].partition(".")[2])
                classes[cls] = classes.get(cls, False) or multimodal
    return classes


__all__ = ["GENERATION_AUTO_CLASSES", "served_model_classes", "served_model_types"]
