"""Safetensors files read and written tensor by tensor, without safetensors' loaders (used by `kimi-hf convert k3`).

- `read_safetensors_header`: a file's tensors (dtype, shape, byte range) from its header alone, a truncated file
  refused; `TensorReader` then reads them one at a time with plain reads (no mmap, whose touched pages would count
  as the process's memory) into fresh tensors.
- `cut_shards` splits planned output tensors into shards of at most a size (bytes: `kimi_hf.sizes.parse_size`),
  `shard_names` names them as transformers does, `shard_header` is a shard's header (written first, so a shard
  is written front to back), `write_tensor` appends one tensor's bytes, `check_written` reads the header back.

torch is imported only by the functions that handle tensor data: the header and size helpers stay instant.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Protocol


INDEX = "model.safetensors.index.json"
# safetensors dtype code -> (torch dtype name, bytes per element)
DTYPES = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "I16": ("int16", 2),
    "I32": ("int32", 4),
    "I64": ("int64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "F64": ("float64", 8),
}
FLOATS = ("F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64")
IO_CHUNK = 1 << 30  # bytes per read / write call (one Linux read() returns at most ~2 GiB)


@dataclass
class StoredTensor:
    """One tensor of a source shard, from its safetensors header: data at bytes [start, end) of file."""

    name: str
    file: str
    dtype: str  # safetensors code: "BF16", "U8", ...
    shape: tuple[int, ...]
    start: int
    end: int


class PlannedTensor(Protocol):
    """What a shard's header, cutting and writing need of a tensor to write (a K3 plan's OutputTensor)."""

    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int: ...


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_names(n: int) -> list[str]:
    """The file names of n shards: model.safetensors alone, else model-0000k-of-0000N.safetensors."""
    return ["model.safetensors"] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def read_safetensors_header(path: str) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file (name -> dtype, shape, absolute byte range), from its header.
    A file too short for what its header promises (a truncated download) is refused, naming the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"cannot read {path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 << 20:
            raise ValueError(f"cannot read {path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {path}: its safetensors header is not valid JSON ({e})") from None
    base, out, end = 8 + n, {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"cannot read {path}: malformed header entry for tensor {name}") from None
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name} (in {path}) has dtype {dtype}, which this converter does not know")
        if b - a != numel(shape) * DTYPES[dtype][1] or a < 0:
            raise ValueError(
                f"tensor {name} (in {path}): its header says {dtype} {list(shape)} at bytes [{a}, {b}), "
                "which is not that size"
            )
        out[name] = StoredTensor(name, os.path.basename(path), dtype, shape, base + a, base + b)
        end = max(end, b)
    if base + end > size:
        raise ValueError(
            f"cannot read {path}: truncated (its header describes {base + end} bytes, the file has {size})"
        )
    return out


class TensorReader:
    """Reads source tensors with plain reads into fresh tensors, keeping one source file open at a time (a
    scale that sits in another shard than its weight_packed is read with a short-lived second handle)."""

    def __init__(self, src: str):
        self.src, self.file, self.handle = src, None, None

    def read(self, t: StoredTensor):
        if t.file == self.file:
            return self._read(self.handle, t)
        with open(os.path.join(self.src, t.file), "rb") as f:
            return self._read(f, t)

    def switch(self, file: str) -> None:
        if file != self.file:
            self.close()
            self.handle, self.file = open(os.path.join(self.src, file), "rb"), file

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.handle = self.file = None

    def _read(self, f, t: StoredTensor):
        import torch

        n = t.end - t.start
        buf = torch.empty(n, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        f.seek(t.start)
        while done < n:
            got = f.readinto(view[done : min(n, done + IO_CHUNK)])
            if not got:
                raise ValueError(f"cannot read tensor {t.name}: {os.path.join(self.src, t.file)} ended early")
            done += got
        return buf.view(getattr(torch, DTYPES[t.dtype][0])).reshape(t.shape)


def shard_header(outputs: list[PlannedTensor]) -> bytes:
    """The header of a shard holding outputs in order: 8-byte length + JSON, padded to 8 bytes as safetensors does."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for o in outputs:
        header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def cut_shards(outputs: list[PlannedTensor], max_bytes: int) -> list[list[PlannedTensor]]:
    """Output shards in order: a new one whenever the next tensor would take the current one past max_bytes
    (a tensor bigger than that gets a shard of its own)."""
    shards, current, size = [], [], 0
    for o in outputs:
        if current and size + o.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(o)
        size += o.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def write_tensor(f, t, out: PlannedTensor) -> None:
    """t's bytes (little-endian, row-major), after checking that t is what the header announced."""
    import torch

    if str(t.dtype).removeprefix("torch.") != DTYPES[out.dtype][0] or tuple(t.shape) != out.shape:
        raise RuntimeError(
            f"internal error: {out.name} came out {t.dtype} {list(t.shape)}, planned {out.dtype} {list(out.shape)}"
        )
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    view = memoryview(data)
    for i in range(0, len(view), IO_CHUNK):
        f.write(view[i : i + IO_CHUNK])


def check_written(path: str, shard: list[PlannedTensor]) -> None:
    """The shard as safetensors reads it: the planned names, dtypes and shapes (a cheap header read)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        got = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    want = {o.name: (o.dtype, o.shape) for o in shard}
    if got != want:
        raise RuntimeError(f"internal error: {path} does not hold the planned tensors")
