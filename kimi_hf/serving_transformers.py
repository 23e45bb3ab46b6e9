"""What `kimi-hf serve` changes in `transformers serve`: subclasses of its model manager (5.24 and 5.25+) and of its
model loader (5.25+), installed where the stock server looks them up (`install`).

transformers' server knows only in-tree models: it resolves `config.architectures[0]` on the transformers module,
and tells text (LLM) from image-text (VLM) models by in-tree class names. Our models are put on the module and get
their kind from the package's one Auto-class table (`hub_kimi.AUTO_MAPS`, through kimi_hf.served_models); a text model
saved beside a processor loads its tokenizer (AutoProcessor would build the multimodal processor for it).

- transformers 5.24 loads models in the server's own process (`ModelManager.load_model_and_processor`).
- transformers 5.25 loads each model in a spawned process, from a pickled copy of the server's `ModelLoader`:
  `KimiModelLoader` is pickled by reference, so the spawned process imports this module and exposes our classes
  there before it loads the model.

`--served-model-name` aliases: requests may name the model by an alias, and `/v1/models` lists the aliases (as vLLM
does with --served-model-name); the path given on the command line is still accepted.

`--adapter DIR`: transformers serve has no adapters, so a PEFT LoRA adapter (in kimi_hf's module names or in the
release's, kimi_hf.adapters_released) is merged into the model when it loads (`PeftModel.from_pretrained(model,
DIR).merge_and_unload()`), in the process that loads it: the server then serves the merged weights.

Importing this module needs transformers' serving extra (fastapi, uvicorn): kimi_hf.serving imports it only to serve.
"""

from __future__ import annotations

import sys

import transformers
import transformers.cli.serving.model_manager as _model_manager
import transformers.cli.serving.utils as _serving_utils
from transformers.cli.serving.utils import Modality


# 5.25 split the model's process off (ModelLoader + EngineClient); 5.24 has the manager alone
SPAWNS_MODEL_PROCESS = hasattr(_model_manager, "ModelLoader")
_StockModelManager = _model_manager.ModelManager


def expose_model_classes() -> dict[type, bool]:
    """Puts the package's generation classes on the transformers module (where transformers serve's loader looks
    `config.architectures[0]` up), registering the Auto classes; returns class -> is an image-text model."""
    from .served_models import served_model_classes

    classes = served_model_classes()
    # the loader's own `transformers` too: in a model process spawned from `python -c`, the transformers module
    # the loader module imported is no longer sys.modules' one by the time the model loads (seen with 5.25)
    for module in {
        id(m): m for m in (transformers, sys.modules.get("transformers"), _model_manager.transformers)
    }.values():
        for cls in classes:
            setattr(module, cls.__name__, cls)
    return classes


def served_modality(model_type: str | None) -> Modality | None:
    """LLM / VLM for a model type `kimi-hf serve` serves (VLM: it has an image-text class), None for others."""
    from .served_models import served_model_types

    entries = served_model_types().get(model_type)
    if entries is None:
        return None
    return Modality.VLM if "AutoModelForImageTextToText" in entries else Modality.LLM


def merge_adapter(model, adapter: str | None):
    """The model with the PEFT LoRA adapter at `adapter` merged into its weights (in place: the same model object),
    or the model as it is when adapter is None."""
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).merge_and_unload()


def _is_tokenizer(processor) -> bool:
    return processor is not None and not hasattr(processor, "image_processor")


def _text_model_tokenizer(repo: str, revision: str | None, trust_remote_code: bool):
    """The tokenizer of a text model of ours at `repo`, or None (another model, or an image-text one)."""
    from transformers import AutoConfig, AutoTokenizer

    expose_model_classes()
    config = AutoConfig.from_pretrained(repo, revision=revision, trust_remote_code=trust_remote_code)
    if served_modality(config.model_type) is Modality.LLM:
        return AutoTokenizer.from_pretrained(repo, revision=revision, trust_remote_code=trust_remote_code)
    return None


class _AliasesMixin:
    """`--served-model-name` aliases of the pinned model (`force_model`): listed by `/v1/models` in its place."""

    aliases: tuple[str, ...] = ()

    def list_models(self, cache_dir: str | None = None) -> list[dict]:
        models = super().list_models(cache_dir)
        if self.force_model is None or not self.aliases:
            return models
        return [{**entry, "id": alias} for entry in models for alias in self.aliases]


if SPAWNS_MODEL_PROCESS:
    _StockModelLoader = _model_manager.ModelLoader
    from transformers.cli.serving.utils import parse_model_id

    class KimiModelLoader(_StockModelLoader):
        """transformers 5.25+'s ModelLoader for this package's models (a copy runs in each model's process)."""

        adapter: str | None = None  # set by install(); copied onto each instance, which is what the copy pickles

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.adapter = type(self).adapter

        def load_processor(self, model_id: str):
            repo, revision, gguf_file = parse_model_id(model_id)
            if gguf_file is None:
                tokenizer = _text_model_tokenizer(repo, revision, self.trust_remote_code)
                if tokenizer is not None:
                    return tokenizer
            return super().load_processor(model_id)

        def _load_model(self, model_id: str, tqdm_class=None, progress_callback=None):
            expose_model_classes()  # in the model's spawned process, which has not run `kimi-hf serve`'s set-up
            model = super()._load_model(model_id, tqdm_class=tqdm_class, progress_callback=progress_callback)
            return merge_adapter(model, self.adapter)

        @staticmethod
        def get_model_modality(config, processor=None) -> Modality | None:
            if _is_tokenizer(processor):
                return Modality.LLM
            return served_modality(config.model_type) or _StockModelLoader.get_model_modality(config, processor)

    class KimiModelManager(_AliasesMixin, _StockModelManager):
        """transformers 5.25+'s ModelManager with `--served-model-name` aliases."""

        def get_engine(self, model: str | None):
            return super().get_engine(dict.fromkeys(self.aliases, self.force_model).get(model, model))

else:

    class KimiModelManager(_AliasesMixin, _StockModelManager):
        """transformers 5.24's ModelManager (models in the server's process) for this package's models."""

        adapter: str | None = None  # set by install()

        def _load_model(self, *args, **kwargs):
            return merge_adapter(super()._load_model(*args, **kwargs), self.adapter)

        def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
            if gguf_file is None:
                repo, revision = _serving_utils.split_revision(model_id_and_revision)
                tokenizer = _text_model_tokenizer(repo, revision, self.trust_remote_code)
                if tokenizer is not None:
                    return tokenizer
            return super()._load_processor(model_id_and_revision, gguf_file=gguf_file)

        @staticmethod
        def get_model_modality(model, processor=None) -> Modality:
            if _is_tokenizer(processor):
                return Modality.LLM
            return served_modality(model.config.model_type) or _StockModelManager.get_model_modality(model, processor)


def _resolve_alias_then(resolve):
    """5.24's handlers check the request's model against the pinned one themselves: an alias becomes the model."""

    def _resolve_model(self, body: dict):
        aliases = getattr(self.model_manager, "aliases", ())
        if body.get("model") in aliases:
            body = {**body, "model": self.model_manager.force_model}
        return resolve(self, body)

    _resolve_model._kimi_hf = True
    return _resolve_model


def install(aliases: list[str] | tuple[str, ...] = (), adapter: str | None = None) -> None:
    """Makes the stock server (`transformers.cli.serve.Serve`) use the classes above: it imports its manager and
    loader from `transformers.cli.serving.model_manager` when it starts, so they are replaced there. adapter: a PEFT
    LoRA adapter folder merged into the model when it loads (`merge_adapter`)."""
    expose_model_classes()
    KimiModelManager.aliases = tuple(aliases)
    _model_manager.ModelManager = KimiModelManager
    if SPAWNS_MODEL_PROCESS:
        KimiModelLoader.adapter = adapter
        _model_manager.ModelLoader = KimiModelLoader
        return
    KimiModelManager.adapter = adapter
    if not getattr(_serving_utils.BaseHandler._resolve_model, "_kimi_hf", False):
        _serving_utils.BaseHandler._resolve_model = _resolve_alias_then(_serving_utils.BaseHandler._resolve_model)


__all__ = [
    "KimiModelManager",
    "SPAWNS_MODEL_PROCESS",
    "expose_model_classes",
    "install",
    "merge_adapter",
    "served_modality",
]
if SPAWNS_MODEL_PROCESS:
    __all__.append("KimiModelLoader")
