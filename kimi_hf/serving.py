"""`transformers serve` for this package's models: an OpenAI-compatible HTTP server.

    python -m kimi_hf.serving MODEL_DIR --port 8000 [--host 127.0.0.1] [--device cpu] [--dtype float32]

transformers' server loads a checkpoint as `getattr(transformers, config.architectures[0])`, so a model
class that lives outside transformers is not found there (trust_remote_code does not change that
path); this launcher exposes our classes to its loader, then runs the stock server. Tool calls in the
replies are parsed with the tokenizer's `response_template` (train_tokenizer sets Kimi's or K3's).

It serves every model type the package registers a generation class for (`served_model_types()`, read off
the one Auto-class table, hub_kimi.AUTO_MAPS): the text models (AutoModelForCausalLM: kimi_hybrid_text,
kimi_k3_text) and the image-text ones (AutoModelForImageTextToText: kimi_hybrid, kimi_k3, Moonshot's released
K3 folders included).

Requests name the model by MODEL exactly as given on the command line (transformers serve pins the
server to it and answers 400 to any other name), or by a `--served-model-name` alias. The multimodal
models take OpenAI `image_url` parts (data: URLs or local files; nothing is downloaded offline).
"""

from __future__ import annotations

import argparse


_ALIASES: dict[str, str] = {}  # request name -> served model (--served-model-name)
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


def expose_models_to_transformers_serve(aliases: dict[str, str] | None = None) -> None:
    """Makes transformers' server load and serve this package's models (`served_model_classes()`).

    - its loader resolves `config.architectures[0]` on the transformers module: our classes are put there;
    - its modality check knows only in-tree class names: ours are text (LLM) and image-text (VLM) models, as
      their AUTO_MAPS entries say (a subclass counts as its most specific listed class);
    - a text model saved beside a processor has `processor_class` in tokenizer_config.json (AutoProcessor
      would then build the multimodal processor for it): text models load their tokenizer;
    - `aliases` maps extra request names (`--served-model-name`) to the served model.
    """
    import transformers.cli.serving.model_manager as manager
    import transformers.cli.serving.utils as serving_utils
    from transformers import AutoConfig, AutoTokenizer

    classes = served_model_classes()
    for cls in classes:
        setattr(manager.transformers, cls.__name__, cls)
    # most derived first, so that a subclass gets its own kind rather than its base's
    modalities = {
        cls: manager.Modality.VLM if multimodal else manager.Modality.LLM
        for cls, multimodal in sorted(classes.items(), key=lambda item: -len(item[0].__mro__))
    }
    text_model_types = {
        model_type
        for model_type, entries in served_model_types().items()
        if "AutoModelForImageTextToText" not in entries
    }
    ModelManager = manager.ModelManager
    if not getattr(ModelManager, "_kimi_hf_patched", False):
        modality, load_processor = ModelManager.get_model_modality, ModelManager._load_processor

        def get_model_modality(model, processor=None):
            if processor is not None and not hasattr(processor, "image_processor"):
                return manager.Modality.LLM  # a tokenizer
            for cls, kind in modalities.items():
                if isinstance(model, cls):
                    return kind
            return modality(model, processor)

        def _load_processor(self, model_id_and_revision, gguf_file=None):
            model_id, revision = serving_utils.split_revision(model_id_and_revision)
            if gguf_file is None:
                config = AutoConfig.from_pretrained(
                    model_id, revision=revision, trust_remote_code=self.trust_remote_code
                )
                if config.model_type in text_model_types:
                    return AutoTokenizer.from_pretrained(
                        model_id, revision=revision, trust_remote_code=self.trust_remote_code
                    )
            return load_processor(self, model_id_and_revision, gguf_file=gguf_file)

        resolve = serving_utils.BaseHandler._resolve_model

        def _resolve_model(self, body):
            if body.get("model") in _ALIASES:
                body = {**body, "model": _ALIASES[body["model"]]}
            return resolve(self, body)

        ModelManager.get_model_modality = staticmethod(get_model_modality)
        ModelManager._load_processor = _load_processor
        serving_utils.BaseHandler._resolve_model = _resolve_model
        ModelManager._kimi_hf_patched = True  # once per process: a second call only adds aliases
    _ALIASES.update(aliases or {})


def check_model_dir(model: str) -> None:
    """A one-line error before the server starts: the directory must exist and hold a model of this package."""
    import json
    import os

    if not os.path.exists(model):
        if os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") != 1:
            raise FileNotFoundError(f"model directory {model!r} does not exist")
        return  # `org/name`: a Hub repo id (from the local cache; transformers says if it is not there)
    if not os.path.isdir(model):
        raise NotADirectoryError(f"model {model!r} is a file, not a model directory (save_pretrained output)")
    config = os.path.join(model, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"{config} does not exist: not a save_pretrained directory")
    try:
        with open(config, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"{config} is not a readable JSON config ({e})") from e
    served = served_model_types()
    if model_type not in served:
        from .models.hub_kimi import AUTO_MAPS

        what = (
            "a part of this package's models without a generation head"
            if model_type in AUTO_MAPS
            else "not one of this package's models"
        )
        raise ValueError(
            f"{config} has model_type {model_type!r}, {what}: kimi-hf serve serves this package's models "
            f"({', '.join(served)}); use `transformers serve` for others"
        )


def main(argv: list[str] | None = None, prog: str = "python -m kimi_hf.serving") -> None:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("model", help="a local model directory (save_pretrained output) or a cached Hub repo id")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, ...")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, ...")
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name that requests may use for the model (besides MODEL itself); repeatable",
    )
    p.add_argument("--log-level", default="warning", help="the server's log level")
    args = p.parse_args(argv)
    check_model_dir(args.model)
    try:  # the serving extra (fastapi, uvicorn, openai) is checked by the import and by Serve() itself
        from transformers.cli.serve import Serve
    except ImportError as e:
        raise SystemExit(f"the server needs transformers' serving extra: pip install 'transformers[serving]' ({e})")
    expose_models_to_transformers_serve(dict.fromkeys(args.served_model_name, args.model))
    Serve(
        force_model=args.model,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        log_level=args.log_level,
    )


if __name__ == "__main__":
    main()
