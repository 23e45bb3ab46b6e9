"""PEFT LoRA adapters of Kimi K3 in the released checkpoint's module names (`moonshotai/Kimi-K3`), for the engines
that serve K3 from those names (vLLM, SGLang, llama.cpp's converter), and back onto kimi_hf's model.

    save_released_adapter(model, out_dir)            a PEFT adapter folder (adapter_config.json +
                                                     adapter_model.safetensors) in the release's names
    released_adapter_state_dict(state_dict, config)  the key map alone: PEFT-saved keys -> the release's
    released_module_name(name, config)               one module of ours -> its released name
    merge_released_adapter(adapter_dir, model_dir, out_dir)
                                                     a released adapter merged into a released folder, streaming
                                                     (the folder an engine without LoRA serves)

Names. A LoRA key `base_model.model.<our module>.lora_A.weight` becomes `base_model.model.<released module>.lora_A.weight`
(lora_B, DoRA's lora_magnitude_vector, an Embedding's lora_embedding_A / _B alike), with the module named as
`released_name` (state_dict_kimi_k3) names its weight: `model.language_model.` -> `language_model.model.`,
`lm_head` -> `language_model.lm_head`, `mlp` -> `block_sparse_moe` on the MoE layers (`shared_experts.gate_proj`,
`routed_expert_up_proj`, ...), the vision tower's MoonViT names (`attn.qkv_proj` -> `encoder.blocks.N.wqkv`,
`attn.proj` -> `wo`, `mlp.fc1` / `fc2` -> `mlp.fc0` / `fc1`), `model.mm_projector.` -> `mm_projector.`. Every
nn.Linear / nn.Embedding of K3 is one released tensor of the same shape (no projection of K3's HF layout is fused
or split; the fusions of the engines, vLLM's `fused_qkv_a_proj` or SGLang's `qkv_proj`, are theirs: they stack the
LoRA factors of the modules they pack), so the factors are copied as they are. Refused, by name: LoRA over parameters
(`target_parameters`: the stacked routed experts, which the release stores per expert as w1 / w3 / w2, or the
router), whole-module copies (`modules_to_save`, `trainable_token_indices`), and an embedding's saved base weight.

target_modules. Written as the shortest dotted suffixes, released names first, that select exactly the adapted
modules both in the release's module tree and in kimi_hf's (PEFT's rule: a module whose name is an entry or ends
with "." + entry): K3_LORA_TARGET_MODULES comes out as itself (K3's leaf names are the release's), "all-linear" as
those leaves plus the tower's. Where a released name cannot reach our module (the MoonViT renames) the entry is
our suffix (`qkv_proj`, `attn.proj`), checked to select nothing else in the release's tree. rank_pattern /
alpha_pattern keys are written the same way.

Loading back, nothing to pass: `PeftModel.from_pretrained(model, dir)` maps the keys with the key map K3's classes
carry (`_checkpoint_conversion_mapping` = state_dict_kimi_k3.released_key_mapping(), which PEFT reads off the model),
transformers' `model.load_adapter(dir)` through K3's conversion mapping (conversion_mapping_kimi_k3). A second adapter
on a PeftModel (`PeftModel.load_adapter(dir, name)`, which reads no map off the model) takes it as its one argument:
`key_mapping=peft_model.get_base_model()._checkpoint_conversion_mapping`. An adapter in kimi_hf's own names loads as
before: every pattern of the map is anchored at a released top-level name, which none of ours starts with.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

import torch

from .atomic_io import atomic_write, set_normal_mode
from .cli_args import check_output_folder
from .conversion.output_dir import output_dir
from .models.kimi_k3.state_dict_kimi_k3 import released_name


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_K3_TYPES = ("kimi_k3", "kimi_k3_text")
# the text-only model (KimiK3ForCausalLM) names its decoder `model.`; the release's is the multimodal one's
_TEXT_ONLY_PREFIX = ("model.", "model.language_model.")
# PEFT's modules inside an adapted module (not modules of the model)
_PEFT_PARTS = ("base_layer", "original_module", "modules_to_save")
# the parts of a state-dict key that PEFT saves with an adapter (LoRA's factors and magnitudes, whole-module copies,
# trainable tokens), which `adapter_tensors` keeps
_ADAPTER_PARTS = (".lora_", ".modules_to_save.", ".trainable_tokens_")


def _config(config_or_model):
    """(the K3 config, whether it is the text-only model's) of a config, a model or a PEFT model."""
    config = getattr(config_or_model, "config", config_or_model)
    model_type = getattr(config, "model_type", None)
    if model_type not in _K3_TYPES:
        raise ValueError(
            f"released adapters are Kimi K3's (model_type kimi_k3 / kimi_k3_text), not model_type {model_type!r}"
        )
    return config, model_type == "kimi_k3_text"


def _sparse_layers(config) -> set[int]:
    text = config.get_text_config()
    return {i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"}


class _Namer:
    """Our module / tensor names -> the release's, for one config (the MoE layers' set computed once)."""

    def __init__(self, config_or_model):
        self.config, self.text_only = _config(config_or_model)
        self.sparse = _sparse_layers(self.config)

    def _multimodal(self, name: str) -> str:
        if self.text_only and name.startswith(_TEXT_ONLY_PREFIX[0]):
            return _TEXT_ONLY_PREFIX[1] + name[len(_TEXT_ONLY_PREFIX[0]) :]
        return name

    def tensor(self, name: str) -> tuple[str, tuple | None]:
        return released_name(self._multimodal(name), self.sparse)

    def module(self, name: str) -> str:
        """A module's released name: its weight's, less `.weight` (a reshaped tensor is refused by name)."""
        released, shape = self.tensor(name + ".weight")
        if shape is not None or not released.endswith(".weight"):
            raise ValueError(f"{name}: its weight is stored reshaped or renamed in Kimi K3's release ({released})")
        return released[: -len(".weight")]


def released_module_name(name: str, config) -> str:
    """One of our module names (a K3 model's, `model.language_model.layers.3.self_attn.q_a_proj`) -> the release's
    (`language_model.model.layers.3.self_attn.q_a_proj`). config: the model's config, or the model."""
    return _Namer(config).module(name)


def _split_key(key: str) -> tuple[str, str]:
    """A PEFT-saved key -> (the module, the rest from the first PEFT part on: `lora_A.weight`, `lora_magnitude_vector`,
    `base_layer.weight`), or (key, "") for a whole-module tensor (modules_to_save)."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part.startswith("lora_") or part in _PEFT_PARTS:
            return ".".join(parts[:i]), ".".join(parts[i:])
    return key, ""


def released_adapter_state_dict(state_dict: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter's saved tensors (`get_peft_model_state_dict`, or an adapter_model.safetensors of a K3
    model of ours: `base_model.model.<module>.lora_A.weight`, no adapter name) under Kimi K3's released module names
    (`base_model.model.<released module>.lora_A.weight`), the tensors themselves unchanged. config: the model's config,
    or the model. ValueError naming the key for what has no released form: a whole-module copy (modules_to_save),
    an embedding's base weight (resized vocabulary), trainable tokens, LoRA over a parameter (target_parameters:
    the stacked routed experts)."""
    namer = _Namer(config)
    out = {}
    for key, tensor in state_dict.items():
        if not key.startswith(_PEFT_PREFIX):
            raise ValueError(f"{key}: not a PEFT LoRA key (expected the {_PEFT_PREFIX!r} prefix)")
        if "trainable_tokens" in key:  # (saved as ...token_adapter.trainable_tokens_delta: no "lora_" part)
            raise ValueError(f"{key}: trainable tokens have no released form; merge the adapter to serve it")
        module, rest = _split_key(key[len(_PEFT_PREFIX) :])
        if not rest.startswith("lora_"):
            what = "an embedding's base weight (a resized vocabulary)" if rest else "a whole module (modules_to_save)"
            raise ValueError(
                f"{key}: {what} has no place in a LoRA adapter served in the release's names; merge the adapter "
                "(merge_and_unload + save_pretrained) to serve it"
            )
        try:
            owner = module.rpartition(".")[2]
            released = namer.module(module)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        if owner in ("experts", "gate") or released.endswith((".experts", ".gate")):
            raise ValueError(
                f"{key}: LoRA over the parameters of {module} (target_parameters) has no released form: the release "
                "stores the routed experts one by one (experts.E.w1 / w3 / w2); adapt their LatentMoE bridges "
                "(routed_expert_up_proj / routed_expert_down_proj) instead, as K3_LORA_TARGET_MODULES does"
            )
        out[f"{_PEFT_PREFIX}{released}.{rest}"] = tensor
    return out


# ---- target_modules valid in both module trees ---------------------------------------------------------------
def _suffixes(name: str) -> list[str]:
    """`a.b.c` -> [`c`, `b.c`, `a.b.c`]: the names PEFT's suffix rule matches it by, shortest first."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts) - 1, -1, -1)]


def _selects(entries: set[str], name: str) -> bool:
    return any(s in entries for s in _suffixes(name))


def _entries(pairs: Iterable[tuple[str, str]], ours_all: set[str], released_all: set[str]) -> list[str]:
    """The shortest dotted suffixes, released ones first, that select exactly the modules `pairs` ((ours, released))
    in both trees by PEFT's rule (a name equal to an entry, or ending with "." + entry)."""
    pairs = sorted(set(pairs), key=lambda p: p[1])
    ours_sel, released_sel = {o for o, _ in pairs}, {r for _, r in pairs}
    bad = {s for n in ours_all - ours_sel for s in _suffixes(n)}
    bad |= {s for n in released_all - released_sel for s in _suffixes(n)}
    chosen: set[str] = set()
    for ours, released in pairs:
        for name in (released, ours):  # the released name first: ours only where it cannot reach our module
            if _selects(chosen, name):
                continue
            entry = next((s for s in _suffixes(name) if s not in bad), None)
            if entry is None:
                raise ValueError(f"{name}: no module name selects it alone in both Kimi K3's release and kimi_hf")
            chosen.add(entry)
    for tree, everything, selected in (
        ("kimi_hf's", ours_all, ours_sel),
        ("the release's", released_all, released_sel),
    ):
        if {n for n in everything if _selects(chosen, n)} != selected:  # cannot happen: `bad` excludes the others
            raise AssertionError(f"target_modules {sorted(chosen)} do not select the adapted modules in {tree} tree")
    return sorted(chosen)


def _our_name(name: str) -> str | None:
    """A module name of a PEFT-wrapped model without PEFT's parts (`x.q_proj.base_layer` -> `x.q_proj`), None for a
    module PEFT added (`x.q_proj.lora_A`)."""
    parts = name.split(".")
    if any(p.startswith("lora_") for p in parts):
        return None
    return ".".join(p for p in parts if p not in _PEFT_PARTS)


def _trees(model, namer: _Namer) -> tuple[set[str], set[str]]:
    """(every module name of ours, every module name of the release's tree) of a model (PEFT-wrapped or not).
    The release's: the prefixes of its tensor names, and the released names of our modules. Its per-expert modules
    (`experts.E.w1`, 250 k at K3's size) are left out: no Linear of K3 is named like them, so no entry can end so."""
    ours, released = set(), set()
    for name, _ in model.named_modules():
        name = _our_name(name)
        if name:
            ours.add(name)
            try:
                released.add(namer.module(name))
            except ValueError:
                pass  # a module above the release's prefixes (`model`): the prefixes below name the release's
    for key in model.state_dict(keep_vars=True):
        key = _our_name(key)
        if key is None:
            continue
        try:
            tensor_name, _ = namer.tensor(key)
        except ValueError:
            continue
        parts = tensor_name.split(".")
        released.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return ours, released


# ---- the adapter folder ----------------------------------------------------------------------------------------
def _base_model(model):
    """The transformers model under a PeftModel (or the model itself, with adapters injected by load_adapter)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _adapted_modules(model, adapter_name: str) -> dict[str, tuple[int, float]]:
    """Our module name -> (r, lora_alpha) of every module carrying LoRA adapter `adapter_name`."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in _base_model(model).named_modules():
        if isinstance(module, LoraLayer) and adapter_name in module.r:  # (target_parameters: refused by the caller)
            found[_our_name(name)] = (module.r[adapter_name], module.lora_alpha[adapter_name])
    if not found:
        raise ValueError(f"the model carries no LoRA adapter named {adapter_name!r}")
    return found


def released_adapter_config(model, adapter_name: str = "default") -> dict:
    """adapter_config.json of a PEFT model's LoRA adapter in Kimi K3's released names: target_modules (and
    rank_pattern / alpha_pattern keys) as `_entries` writes them, layers_to_transform / layers_pattern /
    exclude_modules dropped (target_modules select the adapted modules exactly), base_model_name_or_path and the
    rest kept."""
    from peft import PeftType

    peft_config = model.peft_config[adapter_name]
    if getattr(peft_config, "peft_type", None) != PeftType.LORA:
        raise ValueError(f"adapter {adapter_name!r} is {peft_config.peft_type}, not LoRA")
    for field, what in (("modules_to_save", "whole-module copies"), ("trainable_token_indices", "trainable tokens")):
        if getattr(peft_config, field, None):
            raise ValueError(
                f"adapter {adapter_name!r} has {field} ({what}), which engines do not serve beside a LoRA adapter in "
                "the release's names; merge the adapter (merge_and_unload + save_pretrained) to serve it"
            )
    if getattr(peft_config, "target_parameters", None):
        raise ValueError(
            f"adapter {adapter_name!r} targets parameters {sorted(peft_config.target_parameters)} (target_parameters),"
            " which have no released form: the release stores the routed experts one by one (experts.E.w1 / w3 / w2)"
        )
    base = _base_model(model)
    namer = _Namer(base)
    adapted = _adapted_modules(model, adapter_name)
    ours_all, released_all = _trees(base, namer)
    pairs = {name: namer.module(name) for name in adapted}
    config = peft_config.to_dict()
    config["target_modules"] = _entries(pairs.items(), ours_all, released_all)
    for field, index, default in (("rank_pattern", 0, peft_config.r), ("alpha_pattern", 1, peft_config.lora_alpha)):
        groups: dict = {}
        for name, values in adapted.items():
            if values[index] != default:
                groups.setdefault(values[index], []).append((name, pairs[name]))
        config[field] = {
            re.escape(entry): value
            for value, members in groups.items()
            for entry in _entries(members, ours_all, released_all)
        }
    config.update(layers_to_transform=None, layers_pattern=None, exclude_modules=None, inference_mode=True)
    if not type(base).__module__.startswith("transformers."):  # as PeftModel.save_pretrained: AutoPeftModel's base
        config["auto_mapping"] = {"base_model_class": type(base).__name__, "parent_library": type(base).__module__}
    for key, value in list(config.items()):
        if isinstance(value, set):
            config[key] = sorted(value)
    return config


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    check_output_folder(out_dir, "out_dir")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"adapter folder {out_dir} exists and is not empty: choose another, or overwrite=True")


def _write_adapter(out_dir: str, tensors: dict[str, torch.Tensor], config: dict, overwrite: bool) -> str:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with output_dir(out_dir, ".adapter-", overwrite) as tmp:
        path = os.path.join(tmp, ADAPTER_WEIGHTS)
        save_file({k: t.detach().contiguous() for k, t in tensors.items()}, path, metadata={"format": "pt"})
        set_normal_mode(path)  # safetensors writes 0o600 (through its own temporary file)
        atomic_write(os.path.join(tmp, ADAPTER_CONFIG), json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def adapter_tensors(model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """One adapter's tensors as PEFT saves them (`base_model.model.<module>.lora_A.weight`, no adapter name), whole and
    on the CPU, on every rank of a sharded model.

    Only the adapter's tensors are gathered: PEFT's `get_peft_model_state_dict` of a model sharded at load by
    transformers' DistributedConfig (any of TP / EP / FSDP2) gathers every DTensor of the state dict first, the
    whole base model included, on every rank. Here the state dict is cut to the adapters' entries (`.lora_` parts,
    DoRA's magnitudes) before PEFT sees it. Under tensor parallelism the adapters are DTensors and their gathering
    is a collective: then every rank calls this."""
    from peft import get_peft_model_state_dict

    # FSDP2's state_dict: shards, no communication; PEFT's own tensors only (not `base_layer` nor the base model's)
    ours = {k: v for k, v in model.state_dict().items() if any(p in k for p in _ADAPTER_PARTS)}
    ours = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in ours.items()}
    state = get_peft_model_state_dict(model, state_dict=ours, adapter_name=adapter_name, save_embedding_layers=False)
    # an adapter injected by load_adapter / add_adapter has no PeftModel above it: PEFT's saved names all do
    return {(k if k.startswith(_PEFT_PREFIX) else _PEFT_PREFIX + k): t.detach().cpu() for k, t in state.items()}


def save_released_adapter(
    model, out_dir: str, *, adapter_name: str = "default", base=None, overwrite: bool = False
) -> str:
    """Writes a PEFT LoRA adapter of a Kimi K3 model of ours as a PEFT adapter folder in the release's module names
    (adapter_config.json + adapter_model.safetensors, files 0644 under umask 022, the folder built beside `out_dir`
    and renamed into place: never half written). Returns out_dir.

    model: a PeftModel (or a K3 model with the adapter injected by `load_adapter` / `add_adapter`), or the path of an
    adapter folder saved by PEFT from one (then `base`: the base model's folder, config or model; default the
    adapter's base_model_name_or_path, whose config.json alone is read). out_dir: absent or empty, unless
    overwrite=True. ValueError, naming the module, for what has no released form (see the module docstring).

    Under torch.distributed, with a model (as with `save_pretrained`): every rank calls it, the adapter is gathered
    (`adapter_tensors`), rank 0 writes, and the ranks return together."""
    import torch.distributed as dist

    folder = isinstance(model, (str, os.PathLike))
    if folder:
        model = _meta_peft_model(os.fspath(model), base)
        adapter_name = "default"
    ranks = not folder and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    # checked on every rank before any gathering: a refusal is every rank's
    config = released_adapter_config(model, adapter_name)
    _check_out_dir(out_dir, overwrite)
    state = model._released_adapter_state if folder else adapter_tensors(model, adapter_name)
    if not ranks or dist.get_rank() == 0:
        tensors = released_adapter_state_dict(state, _base_model(model))
        _write_adapter(os.fspath(out_dir), tensors, config, overwrite)
    if ranks:
        dist.barrier()
    return os.fspath(out_dir)


def _meta_peft_model(adapter_dir: str, base):
    """A PeftModel on the meta device (module names and ranks only: no weight is read) carrying the adapter folder's
    config, the folder's tensors attached, for `save_released_adapter` of a folder."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, PretrainedConfig

    import kimi_hf  # the configs and classes, registered

    from .models.hub_kimi import AUTO_MAPS

    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not os.path.isfile(os.path.join(adapter_dir, name)):
            raise FileNotFoundError(f"adapter folder {adapter_dir!r} has no {name}")
    peft_config = LoraConfig.from_pretrained(adapter_dir)
    base = peft_config.base_model_name_or_path if base is None else base
    if not base:
        raise ValueError(f"{adapter_dir}: no base_model_name_or_path in {ADAPTER_CONFIG}; pass base=")
    if isinstance(base, (str, os.PathLike)):
        base = AutoConfig.from_pretrained(os.fspath(base))
    config = base if isinstance(base, PretrainedConfig) else base.config
    _config(config)  # a K3 config, or a ValueError naming the model_type
    entries = AUTO_MAPS[config.model_type]  # the generation class: the multimodal model's, else the causal LM's
    auto = "AutoModelForImageTextToText" if "AutoModelForImageTextToText" in entries else "AutoModelForCausalLM"
    cls = getattr(kimi_hf, entries[auto].partition(".")[2])
    with torch.device("meta"):
        model = get_peft_model(cls._from_config(config), peft_config)
    model._released_adapter_state = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    return model


# ---- a released adapter merged into a released folder -----------------------------------------------------------
def released_adapter_factors(adapter_dir: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{released weight name: (B [out, r], A [r, in], scale)} of a released adapter folder: the delta of the weight is
    scale * B @ A (an embedding's transposed: [vocab, hidden]), scale = lora_alpha / r (/ sqrt(r) with use_rslora),
    by rank_pattern / alpha_pattern where they name the module. DoRA and LoRA biases are refused (not a B @ A)."""
    from peft.utils.other import get_pattern_key
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, ADAPTER_CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    if config.get("use_dora"):
        raise ValueError(f"{adapter_dir}: a DoRA adapter does not merge as W + s B A")
    tensors = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    factors = {}
    for key, a in tensors.items():
        module, rest = _split_key(key.removeprefix(_PEFT_PREFIX))
        if rest in ("lora_A.weight", "lora_embedding_A"):
            b = tensors[key.replace(".lora_A.", ".lora_B.").replace("lora_embedding_A", "lora_embedding_B")]
            embedding = rest == "lora_embedding_A"
        elif rest in ("lora_B.weight", "lora_embedding_B"):
            continue
        else:
            raise ValueError(f"{key}: not a LoRA factor (a LoRA bias or another tuner's tensor does not merge here)")
        r = rank_pattern.get(get_pattern_key(rank_pattern, module), config["r"])
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern, module), config["lora_alpha"])
        scale = alpha / (r**0.5 if config.get("use_rslora") else r)
        # an embedding's delta is (B A)^T: stored as the factors of the transposed product
        factors[module + ".weight"] = (a.T, b.T, scale) if embedding else (b, a, scale)
    return factors


def merge_released_adapter(adapter_dir: str, model_dir: str, out_dir: str, *, overwrite: bool = False) -> dict:
    """The released folder `model_dir` with a released adapter's LoRA merged (W + scale B A in fp32, stored in the
    weight's dtype), streamed shard by shard; everything else (MXFP4 experts, config, tokenizer) copied as it is,
    under the source's shard names and index (kimi_hf.distributed.export's merge). out_dir must not exist unless
    overwrite. Returns {"merged": number of weights}."""
    from .distributed.export import check_export_dir, merge_into_folder

    check_export_dir(out_dir, model_dir, adapter_dir, overwrite)
    return merge_into_folder(model_dir, out_dir, released_adapter_factors(adapter_dir), overwrite)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_tensors",
    "merge_released_adapter",
    "released_adapter_config",
    "released_adapter_factors",
    "released_adapter_state_dict",
    "released_module_name",
    "save_released_adapter",
]
