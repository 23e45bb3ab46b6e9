"""The one check of a model folder before anything loads it (`kimi-hf serve`, the examples, the trainers).

`check_model_folder(path)` reads only small things: that the folder exists, its config.json (valid JSON, a
`model_type` of this package's, or of the types a caller accepts), and every safetensors file's header
against the file's size (a truncated download or copy is named with its byte counts). It raises
`FileNotFoundError` / `NotADirectoryError` / `ValueError` naming the folder, the file or the field, so that a
command prints one line instead of the 15-30 lines of traceback transformers' loader gives for the same folder.
Standard library only (torch is not imported): it runs before any expensive work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable


def is_hub_repo_id(name: str) -> bool:
    """`org/name` that is not a local path: a Hub repo id (loaded from the local cache, or a clear error there)."""
    return not (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1)


def check_model_folder(
    path: str,
    *,
    what: str = "model",
    model_types: Iterable[str] | None = None,
    allow_hub_id: bool = False,
    hint: str = "",
) -> dict:
    """Checks a save_pretrained / released folder and returns its config.json as a dict.

    Args:
        path: the folder.
        what: how the caller names the folder in its errors (an argument: "--model", "MODEL_DIR").
        model_types: the accepted `model_type`s; default: any model of this package (`hub_kimi.AUTO_MAPS`).
        allow_hub_id: `org/name` that does not exist locally is returned unchecked as `{}` (a cached Hub repo).
        hint: appended to the error for another model type (what to use instead).

    Raises `FileNotFoundError`, `NotADirectoryError` or `ValueError` naming `what`, the path and the problem.
    """
    from .conversion.safetensors_stream import INDEX, read_safetensors_header
    from .models.hub_kimi import AUTO_MAPS

    path = os.fspath(path)
    if not os.path.exists(path):
        if allow_hub_id and is_hub_repo_id(path):
            return {}
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"{what} {path!r} is a file, not a model folder (save_pretrained output)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"{what}: {config_file} does not exist (not a save_pretrained folder)")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: {config_file} is not a readable JSON config ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{what}: {config_file} holds a {type(config).__name__}, not a JSON object")
    accepted = list(AUTO_MAPS if model_types is None else model_types)
    model_type = config.get("model_type")
    if model_type not in accepted:
        raise ValueError(
            f"{what}: {config_file} has model_type {model_type!r}, not one this accepts ({', '.join(accepted)})"
            + (f": {hint}" if hint else "")
        )
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{what}: {index} is not a readable safetensors index ({e!r})") from None
        missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise FileNotFoundError(f"{what}: {index} lists shards that are missing: {', '.join(missing)}")
    else:
        files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    for name in files:  # headers only: a few KB a file
        read_safetensors_header(os.path.join(path, name))
    return config


__all__ = ["check_model_folder", "is_hub_repo_id"]
