"""`kimi-hf convert k3`, before any tensor data is read: SRC's config.json, index and safetensors headers, every
check, and the plan of the output (`plan_k3` -> `K3Plan`). Imports no torch: a broken folder is refused in a second,
with one error naming the file, field or tensor at fault.

The release's format, and what becomes of each tensor: k3.py's docstring. The safetensors headers are read by
safetensors_stream.read_safetensors_header.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field

from ..mx_block import MX_BLOCK
from .fp32 import k3_fp32, keeps_fp32
from .safetensors_stream import DTYPES, FLOATS, INDEX, StoredTensor, numel, read_safetensors_header
from .verify import verify_layer_count


MODEL_TYPE = "kimi_k3"
MXFP4_FORMAT = "mxfp4-pack-quantized"
GROUP = MX_BLOCK  # input elements per E8M0 scale (compressed-tensors group_size; kimi_hf.mx_block)
OUT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_EXPERT = re.compile(
    r"^(?P<base>.*\.layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<w>w[123]))"
    r"\.(?P<kind>weight_packed|weight_scale|weight)$"
)
_EXPERT_PREFIX = "language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
# a file or directory of SRC that is not copied: the weights (re-written) and hidden entries (caches)
_SKIP_NAMES = ("config.json", INDEX, "__pycache__")


@dataclass
class OutputTensor:
    """One tensor of the output: `kind` "copy" (source, cast to dtype) or "mxfp4" (source = weight_packed,
    scale = weight_scale, dequantised to dtype)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    source: StoredTensor
    scale: StoredTensor | None = None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * DTYPES[self.dtype][1]


@dataclass
class K3Plan:
    """What `convert_k3` will write, from SRC's config.json and safetensors headers alone."""

    src: str
    config: dict  # the output's config.json
    outputs: list[OutputTensor]  # in source order
    mxfp4: bool  # SRC's experts are MXFP4
    source_files: list[str]
    side_files: list[str] = field(default_factory=list)  # relative paths copied unchanged
    skipped_files: list[str] = field(default_factory=list)  # *.safetensors of SRC its index does not name
    rounded: list[str] = field(default_factory=list)  # tensors cast to a narrower dtype (SRC -> DST not lossless)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


def dtype_name(dtype) -> str:
    """--dtype as a name ("bfloat16" ...): a string or a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in OUT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype!r}")
    return name


# ----------------------------------------------------------------------------------------------------------
# SRC: config.json, the index, the safetensors headers
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


def _check_expert(t: StoredTensor, m: re.Match, where: str, moe: set, experts: int, shapes: dict) -> tuple[int, int]:
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
    out_dtype = OUT_DTYPES[dtype_name(dtype)]
    config = read_k3_config(src)
    path = os.path.join(src, "config.json")
    weight_map = _weight_map(src)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    source_files = sorted(by_file)
    headers: dict[
        str, StoredTensor
    ] = {}  # what the index names (a loader sees nothing else), from each shard's header
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
                OutputTensor(f"{base}.weight", out_dtype, logical[base], "mxfp4", t, headers[f"{base}.weight_scale"])
            )
            continue
        target = t.dtype
        if t.dtype in FLOATS:
            target = "F32" if keeps_fp32(t.name, k3_fp32()) else out_dtype  # the release's F32 tensors stay F32
            if not _exact_cast(t.dtype, target):
                rounded.append(t.name)
        outputs.append(OutputTensor(t.name, target, t.shape, "copy", t))

    config = _output_config(config, dtype_name(dtype))
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
# Before writing: DST, the disk, the memory --verify needs
# ----------------------------------------------------------------------------------------------------------


def check_dst(src: str, dst: str, overwrite: bool) -> None:
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


def check_space(parent: str, plan: K3Plan) -> None:
    need = plan.nbytes + sum(os.path.getsize(os.path.join(plan.src, p)) for p in plan.side_files)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise OSError(f"the output needs {need / 1e9:.2f} GB but {parent} has {free / 1e9:.2f} GB free")


def _layer_of(name: str) -> int | None:
    m = re.match(r"^language_model\.model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def check_verify_memory(plan: K3Plan, layers: int) -> None:
    """--verify holds one float32 copy of the model (of its first layers) at a time: refuse it up front when that
    does not fit the memory available."""
    n = verify_layer_count(plan.config, layers)
    params = sum(numel(o.shape) for o in plan.outputs if (_layer_of(o.name) is None or _layer_of(o.name) < n))
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


__all__ = [
    "GROUP",
    "MODEL_TYPE",
    "MXFP4_FORMAT",
    "OUT_DTYPES",
    "K3Plan",
    "OutputTensor",
    "check_dst",
    "check_space",
    "check_verify_memory",
    "dtype_name",
    "plan_k3",
    "read_k3_config",
    "read_safetensors_header",
]
