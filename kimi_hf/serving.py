"""`transformers serve` for this package's models: an OpenAI-compatible HTTP server.

    python -m kimi_hf.serving MODEL_DIR --port 8000 [--host 127.0.0.1] [--device cpu] [--dtype float32]

transformers' server loads a checkpoint as `getattr(transformers, config.architectures[0])`, so a model
class that lives outside transformers is not found there (trust_remote_code does not change that
path); this launcher exposes our classes to its loader, then runs the stock server. Tool calls in the
replies are parsed with the tokenizer's `response_template` (train_tokenizer sets Kimi's).
"""

from __future__ import annotations

import argparse


def expose_models_to_transformers_serve() -> None:
    import transformers.cli.serving.model_manager as manager

    from . import KimiHybridForCausalLM, KimiHybridForConditionalGeneration  # importing kimi_hf registers the Auto classes

    for cls in (KimiHybridForCausalLM, KimiHybridForConditionalGeneration):
        setattr(manager.transformers, cls.__name__, cls)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kimi_hf.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a local model directory (save_pretrained output) or a cached Hub repo id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    try:  # the serving extra (fastapi, uvicorn, openai) is checked by the import and by Serve() itself
        from transformers.cli.serve import Serve

        expose_models_to_transformers_serve()
        Serve(force_model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
              log_level=args.log_level)
    except ImportError as e:
        raise SystemExit(f"the server needs transformers' serving extra: pip install 'transformers[serving]' ({e})")


if __name__ == "__main__":
    main()
