"""Upload a trained model of this package (with its processor / tokenizer) to the Hugging Face Hub
as one commit: weights, config with auto_map, the model code (so `trust_remote_code=True` loads it
without kimi_hf) and a model card.

    python examples/push_to_hub.py outputs/quickstart/model me/kimi-hybrid-tiny [--private] [--token hf_...]
    python examples/push_to_hub.py outputs/quickstart/model me/kimi-hybrid-tiny --dry-run /tmp/upload  # no network

--dry-run writes exactly the folder that would be uploaded to the given directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from huggingface_hub.utils import validate_repo_id
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

import kimi_hf  # noqa: F401  (registers the Auto classes)
from kimi_hf.cli_args import ArgumentParser
from kimi_hf.model_folder import check_model_folder
from kimi_hf.models.hub_kimi import upload
from kimi_hf.serving import served_model_types


def check_args(args) -> bool:
    """Bad input, found before anything loads (ValueError / OSError naming the argument). Returns whether
    model_dir is an image-text model."""
    types = served_model_types()  # the package's model types with a generation class
    model_type = check_model_folder(args.model_dir, what="model_dir", model_types=types)["model_type"]
    try:
        validate_repo_id(args.repo_id)  # the Hub's rules, checked offline
    except ValueError as e:
        raise ValueError(f"repo_id: {e}") from None
    if args.dry_run and os.path.lexists(args.dry_run):
        raise FileExistsError(f"--dry-run directory {args.dry_run!r} exists already")
    return "AutoModelForImageTextToText" in types[model_type]


def load(model_dir: str, multimodal: bool):
    model = (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_pretrained(model_dir)
    if os.path.exists(os.path.join(model_dir, "processor_config.json")):
        return model, AutoProcessor.from_pretrained(model_dir)
    if os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
        return model, AutoTokenizer.from_pretrained(model_dir)
    return model, None


def main(argv=None) -> str:
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a save_pretrained directory (e.g. the quickstart's outputs/quickstart/model)")
    p.add_argument("repo_id", help="user/name on the Hub")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None, help="default: HF_TOKEN / the cached login")
    p.add_argument("--commit-message", default="Upload kimi_hf model")
    p.add_argument("--dry-run", metavar="DIR", help="write the folder to DIR instead of uploading")
    args = p.parse_args(argv)
    try:
        multimodal = check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))
    model, processor = load(args.model_dir, multimodal)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)  # weights, config + auto_map, code files, model card
        if processor is not None:
            processor.save_pretrained(folder)
        files = sorted(os.listdir(folder))
        if args.dry_run:
            shutil.copytree(folder, args.dry_run)
            print(f"dry run: {len(files)} files in {args.dry_run}: {', '.join(files)}")
            return args.dry_run
        url = upload(folder, args.repo_id, token=args.token, private=args.private, commit_message=args.commit_message)
    print(f"uploaded {len(files)} files to {args.repo_id}: {url}")
    print(f"load: AutoModel.from_pretrained({args.repo_id!r}, trust_remote_code=True)")
    return str(url)


if __name__ == "__main__":
    main()
    sys.exit(0)
