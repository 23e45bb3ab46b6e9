"""Kimi K3 as released (MXFP4 routed experts) -> the same folder with dense experts, in the official names.

The K3 release stores its routed experts in compressed-tensors' `mxfp4-pack-quantized` format: every
`language_model.model.layers.{L}.block_sparse_moe.experts.{E}.w{1,2,3}` is a pair

    .weight_packed [out, in / 2] uint8   two E2M1 codes a byte, element 2j in the low nibble
    .weight_scale  [out, in / 32] uint8  one E8M0 exponent (2^(s - 127)) per 32 input elements

(w1 / w3: [moe_intermediate_size, routed_expert_hidden_size], w2 the transpose), described by
`text_config.quantization_config`. Tools that cannot read MXFP4 need plain tensors; `convert_k3` writes a
copy of the folder where each pair becomes `....w{1,2,3}.weight` [out, in] in --dtype (every value is exactly
representable in bfloat16 and float32: lossless), every other tensor is copied under its own name (cast to
--dtype, except the tensors the release keeps in float32: A_log, dt_bias, the *_conv1d weights, o_norm and
e_score_correction_bias), config.json loses its quantization_config (its `dtype` fields say --dtype) and every
other file (tokenizer, generation config, chat template, remote code, README) is copied unchanged.

How it works, and why:

- Everything is checked first, from config.json and the safetensors headers alone (no tensor data is read
  and torch is not imported): a missing shard, a truncated file, an unpaired or mis-shaped MXFP4 tensor, an
  incomplete set of experts all fail in a second with one error naming the file or tensor.
- The output is planned from the headers (names, dtypes, shapes, shard cuts at --max-shard-size), so each
  output shard is written front to back: its safetensors header, then each tensor as soon as it is converted.
  Source tensors are read one at a time with plain reads (no mmap, whose touched pages would count as the
  process's memory), in the order of the source shards: the peak memory is about one tensor (source + result;
  the largest is the embedding or lm_head), whatever the shard sizes.
- The output is built in a temporary directory next to DST (normal file modes) and renamed at the end; a
  failure (or --verify finding a difference) removes it: DST is never half written.
- `--verify` loads SRC and the new folder with KimiK3ForConditionalGeneration (float32) in a fresh process
  and compares their logits on a fixed short input, before the folder is moved to DST.

This module imports torch only when it converts (`kimi-hf convert k3 --help` and the checks stay instant).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field


INDEX = "model.safetensors.index.json"
MODEL_TYPE = "kimi_k3"
MXFP4_FORMAT = "mxfp4-pack-quantized"
GROUP = 32  # input elements per E8M0 scale (compressed-tensors group_size, the MX block size)
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
OUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# the tensors the K3 release stores in F32 (the KDA gates and short convolutions, the KDA output norm, the
# router's correction bias): they stay F32 whatever --dtype says
KEEP_F32 = (".A_log", ".dt_bias", "_conv1d.weight", ".o_norm.weight", ".e_score_correction_bias")
_EXPERT = re.compile(
    r"^(?P<base>.*\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<w>w[123]))"
    r"\.(?P<kind>weight_packed|weight_scale|weight)$"
)
_EXPERT_PREFIX = "language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
# a file or directory of SRC that is not copied: the weights (re-written) and hidden entries (caches)
_SKIP_NAMES = ("config.json", INDEX, "__pycache__")
_IO_CHUNK = 1 << 30  # bytes per read / write call (one Linux read() returns at most ~2 GiB)

K3_DOC = """Dequantise a Kimi K3 folder: MXFP4 routed experts -> plain tensors, in the official K3 names.

    kimi-hf convert k3 SRC DST [--dtype bfloat16|float16|float32] [--max-shard-size 5GB] [--verify]
                       [--verify-layers N] [--overwrite] [--no-progress]

SRC: a Kimi K3 folder as released (config.json with model_type "kimi_k3", sharded safetensors with
model.safetensors.index.json), its routed experts in compressed-tensors' mxfp4-pack-quantized format. Every
experts.{E}.w{1,2,3}.weight_packed + .weight_scale pair becomes experts.{E}.w{1,2,3}.weight in --dtype
(lossless in bfloat16 and float32); every other tensor keeps its name and is cast to --dtype, except A_log,
dt_bias, the *_conv1d weights, o_norm and e_score_correction_bias, which stay float32. config.json loses its
quantization_config (and says --dtype); every other file of SRC is copied unchanged. A folder whose experts
are already plain tensors is copied and cast.

Everything is checked before any tensor is read. Streaming: one tensor at a time; output shards of at most
--max-shard-size with a new model.safetensors.index.json. The output is written to a temporary directory next
to DST and renamed at the end: a failed or interrupted run leaves nothing at DST. --verify loads SRC and the
result with KimiK3ForConditionalGeneration in float32 in a fresh process (the whole model, or its first
--verify-layers layers) and compares their logits before the result is moved to DST: they must agree to 1e-6
(where --dtype rounded SRC's float32 tensors, SRC's loaded copy is rounded the same way first). DST must be
new or an empty directory; --overwrite replaces an existing one once the new folder is complete.
"""


@dataclass
class _Stored:
    """One tensor of a source shard, from its safetensors header: data at bytes [start, end) of file."""

    name: str
    file: str
    dtype: str  # safetensors code: "BF16", "U8", ...
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class _Output:
    """One tensor of the output: `kind` "copy" (source, cast to dtype) or "mxfp4" (source = weight_packed,
    scale = weight_scale, dequantised to dtype)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    source: _Stored
    scale: _Stored | None = None

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * DTYPES[self.dtype][1]


@dataclass
class K3Plan:
    """What `convert_k3` will write, from SRC's config.json and safetensors headers alone."""

    src: str
    config: dict  # the output's config.json
    outputs: list[_Output]  # in source order
    mxfp4: bool  # SRC's experts are MXFP4
    source_files: list[str]
    side_files: list[str] = field(default_factory=list)  # relative paths copied unchanged
    skipped_files: list[str] = field(default_factory=list)  # *.safetensors of SRC its index does not name
    rounded: list[str] = field(default_factory=list)  # tensors cast to a narrower dtype (SRC -> DST not lossless)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dtype_name(dtype) -> str:
    """--dtype as a name ("bfloat16" ...): a string or a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in OUT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype!r}")
    return name


def parse_size(text) -> int:
    """--max-shard-size: bytes (an int), or "5GB" / "500MB" / "100KB" / "123" (binary units, as `kimi-hf convert
    kimi-linear` reads them), > 0. Parsed here rather than by the shared converters' helper, which imports torch."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        t = str(text).strip().upper()
        units = (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1))
        mult = next((m for unit, m in units if t.endswith(unit)), 1)
        number = next((t[: -len(unit)] for unit, _ in units if t.endswith(unit)), t)
        try:
            size = int(float(number) * mult)
        except (ValueError, OverflowError):
            size = 0
    if size <= 0:
        raise ValueError(f"invalid size {text!r} (e.g. 5GB, 500MB, 100KB or a number of bytes)")
    return size


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ----------------------------------------------------------------------------------------------------------
# Checks and plan (no tensor data, no torch)
# ----------------------------------------------------------------------------------------------------------


def read_k3_config(src: str) -> dict:
    """SRC/config.json, refused unless it is a Kimi K3 one (model_type "kimi_k3" with a text_config)."""
    if not os.path.isdir(src):
        raise FileNotFoundError(f"{src} is not a directory (expected a Kimi K3 folder)")
    path = os.path.join(src, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: {src} is not a Kimi K3 folder")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        got = config.get("model_type") if isinstance(config, dict) else None
        raise ValueError(f"{path}: model_type is {got!r}, expected {MODEL_TYPE!r}: not a Kimi K3 folder")
    if not isinstance(config.get("text_config"), dict):
        raise ValueError(f"{path}: no text_config (a Kimi K3 config.json has one)")
    return config


def read_safetensors_header(path: str) -> dict[str, _Stored]:
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
        if b - a != _numel(shape) * DTYPES[dtype][1] or a < 0:
            raise ValueError(
                f"tensor {name} (in {path}): its header says {dtype} {list(shape)} at bytes [{a}, {b}), "
                "which is not that size"
            )
        out[name] = _Stored(name, os.path.basename(path), dtype, shape, base + a, base + b)
        end = max(end, b)
    if base + end > size:
        raise ValueError(
            f"cannot read {path}: truncated (its header describes {base + end} bytes, the file has {size})"
        )
    return out


def _weight_map(src: str) -> dict[str, str]:
    """tensor name -> shard file, from the index (every shard it names must exist) or the files themselves."""
    index = os.path.join(src, INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index} is not a safetensors index (no weight_map): {e}") from None
        missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(src, v))})
        if missing:
            raise FileNotFoundError(
                f"{index} names shards that do not exist: {', '.join(os.path.join(src, m) for m in missing)}"
            )
        return weight_map
    files = sorted(n for n in os.listdir(src) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no {INDEX} and no .safetensors files in {src}")
    weight_map = {}
    for file in files:
        for name in read_safetensors_header(os.path.join(src, file)):
            if name in weight_map:
                raise ValueError(f"tensor {name} is in both {weight_map[name]} and {file} (in {src})")
            weight_map[name] = file
    return weight_map


def _quantization_configs(config: dict) -> list[tuple[str, dict]]:
    """(where, quantization_config) of the text config and, in a re-serialised config, the top level."""
    found = [("text_config.quantization_config", config["text_config"].get("quantization_config"))]
    found.append(("quantization_config", config.get("quantization_config")))
    return [(where, q) for where, q in found if q is not None]


def _check_quantization(path: str, config: dict, packed: list[str]) -> bool:
    """Whether SRC's experts are MXFP4: MXFP4 tensors need a compressed-tensors mxfp4-pack-quantized
    quantization_config (group size 32, 4-bit floats), and a quantization_config must be that one."""
    quant = _quantization_configs(config)
    for where, q in quant:
        if not isinstance(q, dict):
            raise ValueError(f"{path}: {where} is not an object")
        method, fmt = q.get("quant_method"), q.get("format")
        if method != "compressed-tensors" or fmt != MXFP4_FORMAT:
            raise ValueError(
                f"{path}: {where} has quant_method {method!r}, format {fmt!r}; only compressed-tensors "
                f"{MXFP4_FORMAT!r} (the K3 release's MXFP4 experts) can be dequantised"
            )
        for group, spec in (q.get("config_groups") or {}).items():
            weights = (spec or {}).get("weights") or {}
            for key, want in (("num_bits", 4), ("type", "float"), ("group_size", GROUP)):
                if key in weights and weights[key] != want:
                    raise ValueError(
                        f"{path}: {where}.config_groups.{group}.weights.{key} is {weights[key]!r}, expected {want!r} "
                        f"({MXFP4_FORMAT})"
                    )
    if packed and not quant:
        raise ValueError(
            f"{path} has no text_config.quantization_config, but tensor {packed[0]} is MXFP4-packed: the config "
            f"must say compressed-tensors {MXFP4_FORMAT!r}"
        )
    return bool(packed)


def _expert_geometry(path: str, text: dict) -> tuple[set[int], int, dict[str, tuple[int, int]]]:
    """(MoE layers, experts per layer, logical [out, in] of w1 / w2 / w3) from text_config; no experts: (set(), 0, {})."""
    if text.get("num_experts") is None:
        return set(), 0, {}

    def need(key):
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{path}: text_config.{key} is {value!r}, expected a non-negative integer")
        return value

    experts, layers, inter = need("num_experts"), need("num_hidden_layers"), need("moe_intermediate_size")
    latent = text.get("routed_expert_hidden_size")
    latent = need("hidden_size") if latent is None else need("routed_expert_hidden_size")
    first, freq = text.get("first_k_dense_replace", 0) or 0, text.get("moe_layer_freq", 1) or 1
    moe = {layer for layer in range(first, layers) if layer % freq == 0}
    # w1 = gate and w3 = up project the latent to moe_intermediate_size, w2 = down projects back (K3 release)
    return moe, experts, {"w1": (inter, latent), "w3": (inter, latent), "w2": (latent, inter)}


def _check_expert(t: _Stored, m: re.Match, where: str, moe: set, experts: int, shapes: dict) -> tuple[int, int]:
    """The logical [out, in] of an expert tensor, checked against text_config (the error names the tensor)."""
    layer, e = int(m["layer"]), int(m["e"])
    if layer not in moe:
        raise ValueError(f"tensor {where}: layer {layer} is not an MoE layer of this config")
    if e >= experts:
        raise ValueError(f"tensor {where}: expert {e} is beyond the config's num_experts {experts}")
    out_f, in_f = shapes[m["w"]]
    want = {"weight": (out_f, in_f), "weight_packed": (out_f, in_f // 2), "weight_scale": (out_f, in_f // GROUP)}
    expected = want[m["kind"]]
    if t.shape != expected:
        what = {
            "weight": "",
            "weight_packed": f" (two 4-bit codes a byte: [out, in / 2] of a [{out_f}, {in_f}] weight)",
            "weight_scale": f" (one E8M0 scale per {GROUP} inputs: [out, in / {GROUP}] of a [{out_f}, {in_f}] weight)",
        }[m["kind"]]
        raise ValueError(f"tensor {where} has shape {list(t.shape)}, the config implies {list(expected)}{what}")
    return out_f, in_f


def plan_k3(src: str, dtype="bfloat16") -> K3Plan:
    """Checks SRC and plans the conversion, from config.json and the safetensors headers only (fast, no torch).
    Raises FileNotFoundError / ValueError naming the file, field or tensor at fault."""
    src = os.fspath(src)
    out_dtype = OUT_DTYPES[_dtype_name(dtype)]
    config = read_k3_config(src)
    path = os.path.join(src, "config.json")
    weight_map = _weight_map(src)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    source_files = sorted(by_file)
    headers: dict[str, _Stored] = {}  # what the index names (a loader sees nothing else), from each shard's header
    for file in source_files:
        header = read_safetensors_header(os.path.join(src, file))
        for name in by_file[file]:
            if name not in header:
                raise ValueError(f"{os.path.join(src, INDEX)} puts tensor {name} in {file}, whose header lacks it")
            headers[name] = header[name]
    where = {name: f"{name} (in {os.path.join(src, t.file)})" for name, t in headers.items()}

    packed = sorted(n for n in headers if n.endswith(".weight_packed"))
    mxfp4 = _check_quantization(path, config, packed)
    moe, experts, shapes = _expert_geometry(path, config["text_config"])
    logical: dict[str, tuple[int, int]] = {}  # base name -> [out, in] of every MXFP4 pair
    for name, t in headers.items():
        m = _EXPERT.match(name)
        if m is not None and experts:
            shape = _check_expert(t, m, where[name], moe, experts, shapes)
            if m["kind"] == "weight_packed":
                logical[m["base"]] = shape
        if name.endswith((".weight_packed", ".weight_scale")):
            base, kind = name.rsplit(".", 1)
            other = f"{base}.{'weight_scale' if kind == 'weight_packed' else 'weight_packed'}"
            if other not in headers:
                raise ValueError(f"tensor {where[name]} has no {other.rsplit('.', 1)[1]} ({other} is missing)")
            if t.dtype != "U8":
                raise ValueError(f"tensor {where[name]} has dtype {t.dtype}; MXFP4 {kind} tensors are U8")
            if f"{base}.weight" in headers:
                raise ValueError(f"tensors {where[f'{base}.weight']} and {where[name]} are the same weight twice")
            if kind == "weight_packed" and base not in logical:  # MXFP4 outside the experts: the pair must agree
                p, s = t.shape, headers[other].shape
                if len(p) != 2 or len(s) != 2 or p[0] != s[0] or 2 * p[1] != GROUP * s[1]:
                    raise ValueError(
                        f"tensor {where[name]} {list(p)} and its weight_scale {list(s)} are not one MXFP4 weight "
                        f"(packed [out, in / 2], scale [out, in / {GROUP}])"
                    )
                logical[base] = (p[0], 2 * p[1])
        elif t.dtype == "U8":
            raise ValueError(f"tensor {where[name]} is U8 but neither an MXFP4 weight_packed nor a weight_scale")
    if experts:  # every expert of every MoE layer, as a pair or as a plain tensor
        absent = [
            f"{base}.weight_packed" if mxfp4 else f"{base}.weight"
            for layer in sorted(moe)
            for e in range(experts)
            for w in ("w1", "w2", "w3")
            if (base := _EXPERT_PREFIX.format(layer=layer, e=e, w=w)) not in logical
            and f"{base}.weight" not in headers
        ]
        if absent:
            raise ValueError(
                f"{src} lacks {len(absent)} routed-expert tensor(s), e.g. {', '.join(absent[:3])} "
                f"(the config has {experts} experts in each of layers {min(moe)}..{max(moe)})"
            )

    outputs, rounded = [], []
    rank = {file: k for k, file in enumerate(source_files)}
    order = sorted(headers.values(), key=lambda t: (rank[t.file], t.start))  # the shards in turn, each front to back
    for t in order:
        if t.name.endswith(".weight_scale"):
            continue  # written with its weight_packed
        if t.name.endswith(".weight_packed"):
            base = t.name.removesuffix(".weight_packed")
            outputs.append(
                _Output(f"{base}.weight", out_dtype, logical[base], "mxfp4", t, headers[f"{base}.weight_scale"])
            )
            continue
        target = t.dtype
        if t.dtype in FLOATS:
            target = "F32" if t.name.endswith(KEEP_F32) else out_dtype
            if not _exact_cast(t.dtype, target):
                rounded.append(t.name)
        outputs.append(_Output(t.name, target, t.shape, "copy", t))

    config = _output_config(config, _dtype_name(dtype))
    side, skipped = _side_files(src, set(source_files))
    return K3Plan(src, config, outputs, mxfp4, source_files, side, skipped, rounded)


def _exact_cast(a: str, b: str) -> bool:
    """Whether every value of safetensors dtype a is exactly a value of dtype b."""
    wider = {"F64": {"F64"}, "F32": {"F32", "F64"}, "BF16": {"BF16", "F32", "F64"}, "F16": {"F16", "F32", "F64"}}
    wider.update({f8: {f8, "BF16", "F16", "F32", "F64"} for f8 in ("F8_E4M3", "F8_E5M2")})
    return b in wider.get(a, {a})


def _output_config(config: dict, dtype: str) -> dict:
    """config.json of the output: SRC's, without the quantization_config (text_config's, and a top-level copy
    that a transformers re-serialisation adds), with its dtype fields set to dtype."""
    out = json.loads(json.dumps(config))  # a deep copy, key order kept
    out["text_config"].pop("quantization_config", None)
    out.pop("quantization_config", None)
    out["dtype"] = dtype
    for part in (out, out["text_config"], out.get("vision_config")):
        for key in ("dtype", "torch_dtype"):
            if isinstance(part, dict) and key in part:
                part[key] = dtype
    return out


def _side_files(src: str, shards: set[str]) -> tuple[list[str], list[str]]:
    """(files copied unchanged, *.safetensors skipped), as paths relative to SRC: everything but config.json,
    the index and the weights; hidden entries (caches) are left out. Links are followed (a Hub cache snapshot
    is made of them)."""
    copied, skipped = [], []
    for root, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_NAMES)
        rel_root = os.path.relpath(root, src)
        for name in sorted(files):
            rel = name if rel_root == "." else os.path.join(rel_root, name)
            if name.startswith(".") or (rel_root == "." and name in _SKIP_NAMES) or rel in shards:
                continue
            (skipped if name.endswith(".safetensors") else copied).append(rel)
    return copied, skipped


# ----------------------------------------------------------------------------------------------------------
# Conversion (torch from here on)
# ----------------------------------------------------------------------------------------------------------


class _Reader:
    """Reads source tensors with plain reads into fresh tensors, keeping one source file open at a time (a
    scale that sits in another shard than its weight_packed is read with a short-lived second handle)."""

    def __init__(self, src: str):
        self.src, self.file, self.handle = src, None, None

    def read(self, t: _Stored):
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

    def _read(self, f, t: _Stored):
        import torch

        n = t.end - t.start
        buf = torch.empty(n, dtype=torch.uint8)
        view, done = memoryview(buf.numpy()), 0
        f.seek(t.start)
        while done < n:
            got = f.readinto(view[done : min(n, done + _IO_CHUNK)])
            if not got:
                raise ValueError(f"cannot read tensor {t.name}: {os.path.join(self.src, t.file)} ended early")
            done += got
        return buf.view(getattr(torch, DTYPES[t.dtype][0])).reshape(t.shape)


def _dequantize(out: _Output, packed, scale, src: str):
    """One MXFP4 pair -> ([out, in] of out.dtype, whether exact). bfloat16 / float32: exact, by the codec's table
    decode (no float arithmetic); float16 (which cannot hold every E8M0 scale) is decoded in float32 and cast,
    and may round. Values out of the dtype's range (NaN scale byte 255, huge scales) are refused, naming the
    tensor: a converter must not write inf or NaN weights."""
    import torch

    from ..models.kimi_hybrid.mxfp4_kimi_hybrid import dequantize_mxfp4

    where = f"{out.scale.name} (in {os.path.join(src, out.scale.file)})"
    top = int(scale.max()) if scale.numel() else 0
    if top == 255:
        raise ValueError(f"tensor {where} holds the E8M0 NaN scale byte 255")
    dtype = getattr(torch, DTYPES[out.dtype][0])
    decode = torch.float32 if dtype == torch.float16 else dtype
    w = dequantize_mxfp4(packed, scale, dtype=decode, name=out.name.removesuffix(".weight"), expected_shape=out.shape)
    exact = True
    if dtype != decode:
        narrow = w.to(dtype)
        exact, w = torch.equal(narrow.to(decode), w), narrow
    if (dtype == torch.float16 or top >= 253) and not torch.isfinite(w).all():
        raise ValueError(f"tensor {where}: its scales take values beyond {DTYPES[out.dtype][0]}'s range")
    return w, exact


def _safetensors_header(outputs: list[_Output]) -> bytes:
    """The header of a shard holding outputs in order: 8-byte length + JSON, padded to 8 bytes as safetensors does."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for o in outputs:
        header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _cut(outputs: list[_Output], max_bytes: int) -> list[list[_Output]]:
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


def _rss_mb() -> float:
    """This process's resident memory now, in MB (Linux /proc; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return _peak_rss_mb()


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB: Linux's VmHWM (the high-water mark of this program's own
    memory), else getrusage's ru_maxrss. Not ru_maxrss on Linux: it carries over the RSS of the parent that forked
    this process (the pre-exec copy of its memory), e.g. a test runner's gigabyte."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def _check_dst(src: str, dst: str, overwrite: bool) -> None:
    """DST must be new or an empty directory (or, with overwrite, anything but SRC or a folder holding it)."""
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_src == real_dst:
        raise ValueError(f"DST {dst} is SRC: choose another output directory")
    if not os.path.lexists(dst):
        return
    empty = os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst)
    if empty:
        return
    if not overwrite:
        raise FileExistsError(f"{dst} exists and is not empty; choose a new output directory (or pass --overwrite)")
    if (real_src + os.sep).startswith(real_dst + os.sep):
        raise ValueError(f"--overwrite would delete {dst}, which holds SRC {src}")


def _check_space(parent: str, plan: K3Plan) -> None:
    need = plan.nbytes + sum(os.path.getsize(os.path.join(plan.src, p)) for p in plan.side_files)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise OSError(f"the output needs {need / 1e9:.2f} GB but {parent} has {free / 1e9:.2f} GB free")


def _install(tmp: str, dst: str) -> None:
    """Moves the finished folder to dst: a rename (which also replaces an empty directory); an existing dst
    (overwrite, checked before) is moved aside first and deleted once the new folder is in place."""
    if not os.path.lexists(dst) or (os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst)):
        os.replace(tmp, dst)
        return
    old = os.path.join(os.path.dirname(os.path.abspath(dst)), f".{os.path.basename(dst)}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.unlink(old)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="converting", unit="B", unit_scale=True, unit_divisor=1024)


def convert_k3(
    src,
    dst,
    dtype="bfloat16",
    max_shard_size="5GB",
    verify=False,
    overwrite=False,
    *,
    verify_layers: int = 0,
    show_progress: bool | None = False,
) -> dict:
    """Writes DST: Kimi K3 folder SRC with its MXFP4 routed experts dequantised, in the official K3 names.

    src: a K3 folder (config.json model_type "kimi_k3", safetensors shards + index); dst: a new or empty
    directory (overwrite=True replaces an existing one once the new folder is complete). dtype: "bfloat16",
    "float16" or "float32" (a torch.dtype works too) for the experts and every floating tensor but the F32
    ones of the release; max_shard_size: bytes or "5GB" / "500MB". verify: compare the logits of SRC and the
    result (KimiK3ForConditionalGeneration, float32, fresh process; its first verify_layers layers, 0 = all)
    before the result is moved to dst. show_progress: a progress bar on stderr (None: when it is a terminal).

    Returns {"dst", "dtype", "tensors", "experts_dequantised", "shards", "bytes", "seconds", "lossless",
    "rounded_tensors", "copied_files", "skipped_files", "peak_rss_mb", "peak_rss_growth_mb"} (+ "verify": the
    comparison) where experts_dequantised counts the MXFP4 weights (one per expert and w1 / w2 / w3), bytes
    is the tensor data written, lossless False when a tensor was cast to a narrower
    dtype (float32 tensors of SRC to bfloat16, or float16 that could not hold an expert exactly), and
    peak_rss_growth_mb the peak resident memory of the conversion above what the process held before it.
    Errors (FileNotFoundError, FileExistsError, ValueError, OSError) name the file or tensor at fault.
    """
    t0 = time.time()
    src, dst = os.fspath(src), os.fspath(dst)
    max_bytes = parse_size(max_shard_size)
    plan = plan_k3(src, dtype)  # everything checkable is checked here, before any tensor is read
    _check_dst(src, dst, overwrite)
    # a DST inside SRC (re-run with overwrite) is not one of SRC's files
    inside = os.path.realpath(dst) + os.sep
    plan.side_files = [p for p in plan.side_files if not os.path.realpath(os.path.join(src, p)).startswith(inside)]
    plan.skipped_files = [
        p for p in plan.skipped_files if not os.path.realpath(os.path.join(src, p)).startswith(inside)
    ]
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of {dst} does not exist")
    _check_space(parent, plan)
    if verify:
        _check_verify_memory(plan, verify_layers)

    import torch

    from ..models.kimi_hybrid.hub_kimi_hybrid import atomic_write, make_temp_dir

    if sys.byteorder != "little":
        raise OSError(
            "safetensors files are little-endian; this converter reads and writes them on little-endian hosts"
        )
    shards = _cut(plan.outputs, max_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    baseline = _rss_mb()
    tmp = make_temp_dir(parent, ".convert-k3-")
    reader = _Reader(src)
    bar = _progress(plan.nbytes, sys.stderr.isatty() if show_progress is None else show_progress)
    experts, inexact = 0, []
    try:
        for shard, file in zip(shards, names):
            with open(os.path.join(tmp, file), "wb") as f:
                f.write(_safetensors_header(shard))
                for out in shard:
                    reader.switch(out.source.file)  # the source shards in order, one open at a time
                    if out.kind == "mxfp4":
                        t, exact = _dequantize(out, reader.read(out.source), reader.read(out.scale), src)
                        experts += 1
                        if not exact:
                            inexact.append(out.name)
                    else:
                        t = reader.read(out.source)
                        t = t.to(getattr(torch, DTYPES[out.dtype][0]))
                    _write_tensor(f, t, out)
                    del t
                    if bar is not None:
                        bar.update(out.nbytes)
            _check_written(os.path.join(tmp, file), shard)
        reader.close()
        if len(shards) > 1:
            weight_map = {o.name: file for shard, file in zip(shards, names) for o in shard}
            index = {"metadata": {"total_size": plan.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write(os.path.join(tmp, INDEX), json.dumps(index, indent=2) + "\n")
        atomic_write(os.path.join(tmp, "config.json"), json.dumps(plan.config, indent=2) + "\n")
        for rel in plan.side_files:
            os.makedirs(os.path.join(tmp, os.path.dirname(rel)), exist_ok=True)
            shutil.copyfile(os.path.join(src, rel), os.path.join(tmp, rel))  # contents only: normal modes
        if bar is not None:
            bar.close()
            bar = None
        peak = _peak_rss_mb()
        lossless = not plan.rounded and not inexact
        report = {
            "dst": dst,
            "dtype": _dtype_name(dtype),
            "tensors": len(plan.outputs),
            "experts_dequantised": experts,
            "shards": len(shards),
            "bytes": plan.nbytes,
            "lossless": lossless,
            "rounded_tensors": plan.rounded + inexact,
            "copied_files": plan.side_files,
            "skipped_files": plan.skipped_files,
            "peak_rss_mb": peak,
            "peak_rss_growth_mb": max(0.0, peak - baseline),
        }
        if verify:
            report["verify"] = verify_k3(src, tmp, verify_layers, None if lossless else _dtype_name(dtype))
        _install(tmp, dst)
    except BaseException:
        reader.close()
        if bar is not None:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report["seconds"] = time.time() - t0
    return report


def _write_tensor(f, t, out: _Output) -> None:
    """t's bytes (little-endian, row-major), after checking that t is what the header announced."""
    import torch

    if str(t.dtype).removeprefix("torch.") != DTYPES[out.dtype][0] or tuple(t.shape) != out.shape:
        raise RuntimeError(
            f"internal error: {out.name} came out {t.dtype} {list(t.shape)}, planned {out.dtype} {list(out.shape)}"
        )
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    view = memoryview(data)
    for i in range(0, len(view), _IO_CHUNK):
        f.write(view[i : i + _IO_CHUNK])


def _check_written(path: str, shard: list[_Output]) -> None:
    """The shard as safetensors reads it: the planned names, dtypes and shapes (a cheap header read)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        got = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    want = {o.name: (o.dtype, o.shape) for o in shard}
    if got != want:
        raise RuntimeError(f"internal error: {path} does not hold the planned tensors")


# ----------------------------------------------------------------------------------------------------------
# --verify: both folders through KimiK3ForConditionalGeneration in a fresh process
# ----------------------------------------------------------------------------------------------------------

VERIFY_TOKENS = 16
VERIFY_ATOL = 1e-6  # max |diff| of the logits: both models hold the same float32 values, so only noise may differ


def _layer_of(name: str) -> int | None:
    m = re.match(r"^language_model\.model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _verify_layer_count(config: dict, layers: int) -> int:
    """The layers --verify loads: all (layers 0 or >= the model's), else the first `layers`, extended to the first
    MLA layer (the cache counts tokens in an attention layer, as in the Kimi Linear verification)."""
    text = config["text_config"]
    n = text["num_hidden_layers"]
    if not layers or layers >= n:
        return n
    full = (text.get("linear_attn_config") or {}).get("full_attn_layers") or []
    return min(n, max(layers, min(full) if full else 0))


def _check_verify_memory(plan: K3Plan, layers: int) -> None:
    """--verify holds one float32 copy of the model (of its first layers) at a time: refuse it up front when that
    does not fit the memory available."""
    n = _verify_layer_count(plan.config, layers)
    params = sum(_numel(o.shape) for o in plan.outputs if (_layer_of(o.name) is None or _layer_of(o.name) < n))
    need = 4 * params
    try:
        with open("/proc/meminfo") as f:
            available = 1024 * next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return
    if need > 0.8 * available:
        raise ValueError(
            f"--verify would load a float32 copy of {n} layers ({need / 1e9:.1f} GB); {available / 1e9:.1f} GB of "
            "memory is available: pass --verify-layers with fewer layers, or leave out --verify"
        )


def verify_k3(src: str, dst: str, layers: int = 0, round_to: str | None = None) -> dict:
    """Loads src and dst with KimiK3ForConditionalGeneration in float32, one after the other, in a fresh process
    (nothing of this process's state leaks in), and compares their logits on a fixed input of VERIFY_TOKENS
    tokens; layers: the first layers only (0: the whole model).

    round_to: None when dst holds exactly src's values (bfloat16 or float32 output of a bfloat16 release). Else
    the dtype ("bfloat16" / "float16") the conversion rounded src's wider tensors to: src's loaded parameters are
    rounded the same way (all but the float32-kept A_log, dt_bias, *_conv1d, o_norm, e_score_correction_bias)
    before its logits are computed. Either way both models then hold identical values and the logits must agree
    to VERIFY_ATOL (a tolerance would hide a wrong tensor: in a MoE, any change can move a token to other
    experts). Returns {"max_abs_diff", "max_abs_logit", "layers", "tokens", "round_to", ...}; raises ValueError
    when the logits differ by more, or when dst loads with missing or unexpected tensors."""
    cmd = [sys.executable, "-m", "kimi_hf.conversion.k3", "--verify-worker", src, dst, str(layers), round_to or "none"]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = " ".join(out.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"--verify could not load and run the models: {tail}")
    result = json.loads(lines[-1])
    if result["dst_missing"] or result["dst_unexpected"]:
        raise ValueError(
            f"the converted folder loads with missing tensors {result['dst_missing'][:3]} or unexpected ones "
            f"{result['dst_unexpected'][:3]}"
        )
    diff, peak = result["max_abs_diff"], result["max_abs_logit"]
    if not diff <= VERIFY_ATOL:
        reference = f"{src} (its tensors rounded to {round_to} as converted)" if round_to else src
        raise ValueError(
            f"--verify: the logits of {reference} and of the converted folder differ by {diff:.3g} (largest logit "
            f"{peak:.3g}), more than {VERIFY_ATOL:g}"
        )
    return result


def _verify_worker(src: str, dst: str, layers: int, round_to: str) -> None:
    import torch

    from kimi_hf import KimiK3Config, KimiK3ForConditionalGeneration

    def logits(path, round_to=None):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        n = _verify_layer_count(cfg, layers)
        truncated = n < cfg["text_config"]["num_hidden_layers"]
        if truncated:
            text = cfg["text_config"]
            text["num_hidden_layers"] = n
            lac = text.get("linear_attn_config")
            if lac:
                for key in ("kda_layers", "full_attn_layers"):
                    lac[key] = [i for i in lac.get(key, []) if i <= n]  # 1-based layer lists
        config = KimiK3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")})
        model, info = KimiK3ForConditionalGeneration.from_pretrained(
            path, config=config, dtype=torch.float32, output_loading_info=True
        )
        if round_to is not None:  # what the conversion did to SRC's tensors wider than --dtype
            dtype = getattr(torch, round_to)
            with torch.no_grad():
                for name, t in model.state_dict().items():
                    if t.is_floating_point() and not name.endswith(KEEP_F32):
                        t.copy_(t.to(dtype))
        vocab = config.text_config.vocab_size
        ids = torch.randint(0, vocab, (1, VERIFY_TOKENS), generator=torch.Generator().manual_seed(0))
        ids = ids.masked_fill(ids == config.image_token_id, 1)  # text only: no image features to place
        with torch.no_grad():
            value = model.eval()(input_ids=ids, use_cache=False).logits
        keys = ([], []) if truncated else (sorted(info["missing_keys"]), sorted(info["unexpected_keys"]))
        del model
        return value, keys, n

    a, _, n = logits(src, None if round_to == "none" else round_to)
    b, (missing, unexpected), _ = logits(dst)
    print(
        json.dumps(
            {
                "max_abs_diff": (a - b).abs().max().item(),
                "max_abs_logit": a.abs().max().item(),
                "layers": n,
                "tokens": VERIFY_TOKENS,
                "round_to": None if round_to == "none" else round_to,
                "dst_missing": missing,
                "dst_unexpected": unexpected,
            }
        )
    )


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def _layers_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"invalid number of layers {text!r} (0: all, N: the first N)")
    return n


def k3_parser(prog: str | None = None):
    from .cli import ArgumentParser

    p = ArgumentParser(prog=prog, description=K3_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="a Kimi K3 folder (config.json + safetensors shards + index)")
    p.add_argument("dst", metavar="DST", help="output directory (new or empty; see --overwrite)")
    p.add_argument(
        "--dtype",
        choices=list(OUT_DTYPES),
        default="bfloat16",
        help="dtype of the experts and the other floating tensors (A_log, dt_bias, *_conv1d, o_norm and "
        "e_score_correction_bias stay float32); default bfloat16",
    )
    p.add_argument("--max-shard-size", type=_size_arg, default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--verify", action="store_true", help="compare the logits of SRC and the result (fresh process)")
    p.add_argument(
        "--verify-layers", type=_layers_arg, default=0, help="decoder layers --verify loads (default 0: all)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace DST if it exists (once the new folder is complete)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def k3_main(argv=None, prog: str | None = None) -> dict:
    """`kimi-hf convert k3` (prog: the program named in the usage)."""
    args = k3_parser(prog).parse_args(argv)
    report = convert_k3(
        args.src,
        args.dst,
        args.dtype,
        args.max_shard_size,
        verify=args.verify,
        overwrite=args.overwrite,
        verify_layers=args.verify_layers,
        show_progress=False if args.no_progress else None,
    )
    rounded = "" if report["lossless"] else f" ({len(report['rounded_tensors'])} tensors rounded to it)"
    print(
        f"wrote {args.dst}: {report['tensors']} tensors ({report['experts_dequantised']} MXFP4 expert weights dequantised) "
        f"in {report['shards']} shard(s), {report['bytes'] / 1e9:.3f} GB of {report['dtype']}{rounded}, "
        f"{len(report['copied_files'])} other files copied; {report['seconds']:.1f} s, peak memory "
        f"{report['peak_rss_mb']:.0f} MB (+{report['peak_rss_growth_mb']:.0f} MB while converting)"
    )
    if report["skipped_files"]:
        print(
            f"note: not copied (safetensors files that SRC's index does not name): {', '.join(report['skipped_files'])}"
        )
    if "verify" in report:
        v = report["verify"]
        how = f" (SRC's wider tensors rounded to {v['round_to']}, as converted)" if v["round_to"] else ""
        print(
            f"verified: SRC{how} and DST give the same logits (max |diff| {v['max_abs_diff']:.2g}, largest logit "
            f"{v['max_abs_logit']:.3g}; {v['layers']} layers, {v['tokens']} tokens, float32)"
        )
    return report


__all__ = ["convert_k3", "plan_k3", "verify_k3", "read_k3_config", "read_safetensors_header", "k3_main", "k3_parser"]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verify-worker"]:
        _verify_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(f"usage: {sys.executable} -m kimi_hf.conversion.k3 --verify-worker SRC DST LAYERS ROUND_TO|none")
