"""`transformers serve` for this package's models: an OpenAI-compatible HTTP server.

    python -m kimi_hf.serving MODEL_DIR --port 8000 [--host 127.0.0.1] [--device cpu] [--dtype float32]
                              [--adapter ADAPTER_DIR]

transformers' server loads a checkpoint as `getattr(transformers, config.architectures[0])`, so a model
class that lives outside transformers is not found there (trust_remote_code does not change that
path); this launcher installs its manager and loader for our classes (`kimi_hf.serving_transformers`: transformers
5.24, which serves models in its own process, and 5.25+, which spawns a process per model), then runs the stock
server. Tool calls in the replies are parsed with the tokenizer's `response_template` (train_tokenizer sets Kimi's
or K3's).

It serves every model type the package registers a generation class for (`served_model_types()`, read off
the one Auto-class table, hub_kimi.AUTO_MAPS): the text models (AutoModelForCausalLM: kimi_hybrid_text,
kimi_k3_text) and the image-text ones (AutoModelForImageTextToText: kimi_hybrid, kimi_k3, Moonshot's released
K3 folders included).

Requests name the model by MODEL exactly as given on the command line (transformers serve pins the
server to it and answers 400 to any other name), or by a `--served-model-name` alias, which `/v1/models` then
lists in the path's place. The multimodal
models take OpenAI `image_url` parts (data: URLs or local files; nothing is downloaded offline).

`--adapter ADAPTER_DIR` serves MODEL with a PEFT LoRA adapter (saved by PEFT in kimi_hf's names, or in Kimi K3's
released names by kimi_hf.adapters_released.save_released_adapter): transformers serve has no adapters, so the
adapter is merged into the weights when the model loads (`merge_and_unload`); requests still name MODEL.
"""

from __future__ import annotations

import argparse
import os

from .served_models import GENERATION_AUTO_CLASSES, served_model_classes, served_model_types  # noqa: F401


def check_model_dir(model: str) -> None:
    """A one-line error before the server starts: the folder must exist, hold a model type this command serves and
    readable weights (`kimi_hf.model_folder.check_model_folder`); an `org/name` that is not a local path is a Hub
    repo id (from the local cache; transformers says if it is not there)."""
    from .model_folder import check_model_folder

    check_model_folder(
        model,
        what="model directory",
        model_types=served_model_types(),
        allow_hub_id=True,
        hint="kimi-hf serve serves this package's models with a generation head; use `transformers serve` for others",
    )


def check_adapter_dir(adapter: str) -> None:
    """A one-line error before the server starts: a PEFT LoRA adapter folder (adapter_config.json naming LoRA, and
    adapter_model.safetensors)."""
    import json

    from .cli_args import check_output_folder

    if not os.path.exists(adapter):
        raise FileNotFoundError(f"--adapter {adapter!r} does not exist")
    check_output_folder(adapter, "--adapter")
    config = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(config):
        raise ValueError(f"--adapter {adapter!r} is not a PEFT adapter folder (no adapter_config.json)")
    with open(config, encoding="utf-8") as f:
        peft_type = json.load(f).get("peft_type")
    if peft_type != "LORA":
        raise ValueError(f"--adapter {adapter!r}: peft_type {peft_type!r}, only LoRA adapters are merged")
    if not os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")):
        raise ValueError(f"--adapter {adapter!r} has no adapter_model.safetensors")


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
    p.add_argument(
        "--adapter",
        metavar="ADAPTER_DIR",
        help="a PEFT LoRA adapter folder (kimi_hf's names or Kimi K3's released ones) merged into the model at load",
    )
    p.add_argument("--log-level", default="warning", help="the server's log level")
    args = p.parse_args(argv)
    check_model_dir(args.model)
    if args.adapter is not None:
        check_adapter_dir(args.adapter)
    try:  # the serving extra (fastapi, uvicorn, openai) is checked by the import and by Serve() itself
        from transformers.cli.serve import Serve
    except ImportError as e:
        raise SystemExit(f"the server needs transformers' serving extra: pip install 'transformers[serving]' ({e})")
    from .serving_transformers import install

    install(aliases=args.served_model_name, adapter=args.adapter and os.path.abspath(args.adapter))
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
