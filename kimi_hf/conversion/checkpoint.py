"""Streaming checkpoint I/O for the conversion tools: read safetensors tensors one at a time, write
size-limited shards with an index, atomically (`output_dir`: a temporary directory renamed at the end)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..atomic_io import set_normal_mode
from ..sizes import parse_size
from .output_dir import discard, install, make_output_dir
from .safetensors_stream import INDEX, shard_names


def read_config(path: str) -> dict:
    """config.json of a checkpoint directory."""
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(file) as f:
        return json.load(f)


class CheckpointReader:
    """A checkpoint directory: config.json and safetensors shards (with or without an index).

    Tensors are read lazily, one at a time, with one shard open at a time. Missing shards and unreadable files raise errors that name the file.
    """

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is not a checkpoint directory")
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            missing = sorted({v for v in weight_map.values() if not os.path.exists(os.path.join(path, v))})
            if missing:
                raise FileNotFoundError(f"{INDEX} in {path} lists shards that are missing: {missing}")
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {path}")
            weight_map = {}
            for name in files:
                for key in self._open(name).keys():
                    if key in weight_map:
                        raise ValueError(f"tensor {key} is in both {weight_map[key]} and {name}")
                    weight_map[key] = name
        self.weight_map = weight_map
        self._handles: dict[str, object] = {}

    def _open(self, file: str):
        try:
            return safe_open(os.path.join(self.path, file), framework="pt")
        except Exception as e:  # a truncated or foreign file
            raise ValueError(f"cannot read {os.path.join(self.path, file)}: {e}") from None

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles = {file: self._open(file)}  # one open shard at a time
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def file_of(self, name: str) -> str:
        return self.weight_map[name]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.weight_map[name]).get_tensor(name)


class ShardedWriter:
    """Collects tensors into shards of at most max_shard_bytes (a bigger tensor gets a shard of its
    own), in a temporary directory next to dst (`output_dir.make_output_dir`); `finish` writes the index and
    installs it as dst. dst must not exist (its parent is created), or with overwrite=True it is replaced once the
    new folder is complete (`output_dir.install`). Used as a context manager, an exception removes the temporary
    directory: no half-written output."""

    def __init__(self, dst: str, max_shard_bytes: int | str = "5GB", overwrite: bool = False):
        max_shard_bytes = parse_size(max_shard_bytes, "max_shard_size")  # before anything is created
        if os.path.exists(dst) and not overwrite:
            raise FileExistsError(f"{dst} exists; choose a new output directory")
        os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
        self.dst, self.max_shard_bytes, self.overwrite = dst, max_shard_bytes, overwrite
        self.tmp = make_output_dir(dst, ".convert-")
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.shards: list[list[str]] = []
        self.seen: set[str] = set()
        self.total_bytes = 0

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        return False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.seen:
            raise ValueError(f"tensor {name} produced twice: mixed checkpoint namings in the input?")
        self.seen.add(name)
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_shard_bytes:
            self.flush()
        self.current[name] = tensor.contiguous()
        self.current_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.current:
            return
        path = os.path.join(self.tmp, f"shard-{len(self.shards):05d}.safetensors")
        save_file(self.current, path, metadata={"format": "pt"})
        set_normal_mode(path)  # safetensors writes 0o600 (through its own temporary file)
        self.shards.append(list(self.current))
        self.current, self.current_bytes = {}, 0

    def write_json(self, name: str, obj: dict) -> None:
        with open(os.path.join(self.tmp, name), "w") as f:
            json.dump(obj, f, indent=2)

    def copy(self, src_file: str) -> None:
        """Copies the contents only: the copy gets normal permissions, whatever the source's."""
        shutil.copyfile(src_file, os.path.join(self.tmp, os.path.basename(src_file)))

    def finish(self) -> list[str]:
        """Names the shards model-0000k-of-0000N.safetensors (model.safetensors if one), writes the index
        when sharded, installs the directory as dst (`output_dir.install`). Returns the shard file names."""
        self.flush()
        n = len(self.shards)
        names = shard_names(n)
        weight_map = {}
        for k, (keys, name) in enumerate(zip(self.shards, names)):
            os.rename(os.path.join(self.tmp, f"shard-{k:05d}.safetensors"), os.path.join(self.tmp, name))
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            self.write_json(INDEX, {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})
        install(self.tmp, self.dst, self.overwrite)
        return names

    def abort(self) -> None:
        discard(self.tmp)
