"""Kimi Linear checkpoints: Moonshot's original / transformers' `kimi_linear` naming <-> ours.

Moonshot's original checkpoints and transformers' own `save_pretrained` of KimiLinearForCausalLM use
one naming ("native" below): `block_sparse_moe.experts.{e}.w1/w2/w3`, `A_log` as [1, 1, H, 1],
separate `q/k/v_conv1d` (transformers' in-memory layout stacks them into one `conv1d`, accepted too),
and the dense layer 0 as `block_sparse_moe.{gate,up,down}_proj` or `mlp.{gate,up,down}_proj`.
Ours stacks the routed experts ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) and keeps A_log [H].

Conversion streams layer by layer: only one layer's tensors (a layer's experts are stacked into the
largest tensor) and the output shard being filled are in memory.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import torch

from .checkpoint import CheckpointReader, ShardedWriter, read_config
from .fp32 import keeps_fp32, kimi_linear_fp32
from .monitor import peak_rss_mb, progress
from .tokenizer import convert_tokenizer_dir, stop_generation_at_turn_end
from .verify import compare_logits


OURS, NATIVE = "kimi_hybrid_text", "kimi_linear"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_NATIVE_RENAMES = {"num_local_experts": "num_experts"}
EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tiktoken.model",
    "tokenization_kimi.py",
)


def _normalize(name: str) -> str:
    """A native tensor name in our module layout (before experts are stacked and conv1d is split)."""
    return name.replace(".block_sparse_moe.", ".mlp.").replace(".self_attn.forget_gate.", ".self_attn.")


def native_to_ours(tensors, num_heads: int, num_experts: int | None = None):
    """(name, tensor) in the native naming -> ours, for the tensors of one layer (or the non-layer ones).

    Routed experts are stacked into [E, 2I, H] / [E, H, I]; E is num_experts when given, else one more
    than the largest expert index seen. Errors name the tensors as the checkpoint spells them.
    """
    experts = defaultdict(dict)  # prefix -> {(e, w): tensor}
    spelled = {}  # prefix -> the source name of one of its experts, to spell a missing one's name
    for source, t in tensors:
        name = _normalize(source)
        if (m := _EXPERT.match(name)) is not None:
            experts[m.group(1)][(int(m.group(2)), m.group(3))] = t
            spelled.setdefault(m.group(1), source)
            continue
        if name.endswith(".self_attn.A_log"):
            if t.numel() != num_heads:
                raise ValueError(
                    f"tensor {source} has shape {tuple(t.shape)}: expected {num_heads} values (one per head)"
                )
            yield name, t.reshape(num_heads)
        elif name.endswith(".self_attn.conv1d.weight"):  # transformers' in-memory layout: q, k, v stacked
            if t.shape[0] % 3:
                raise ValueError(f"tensor {source} has shape {tuple(t.shape)}: expected q, k and v stacked on dim 0")
            for part, w in zip("qkv", t.chunk(3, dim=0)):
                yield name.replace("conv1d", f"{part}_conv1d"), w.contiguous()
        else:
            yield name, t
    for prefix, parts in experts.items():
        E = num_experts if num_experts is not None else 1 + max(e for e, _ in parts)
        for e, w in sorted(parts):
            if e >= E:
                raise ValueError(f"tensor {_expert_name(spelled[prefix], e, w)} is beyond the config's {E} experts")
        for e in range(E):
            for w in ("w1", "w2", "w3"):
                if (e, w) not in parts:
                    raise ValueError(
                        f"tensor {_expert_name(spelled[prefix], e, w)} is missing (experts must come complete)"
                    )
        try:
            gate_up = torch.stack([torch.cat([parts[(e, "w1")], parts[(e, "w3")]]) for e in range(E)])
            down = torch.stack([parts[(e, "w2")] for e in range(E)])
        except RuntimeError as err:  # experts of different shapes (`convert` checks each one first)
            raise ValueError(
                f"the experts {_expert_name(spelled[prefix], '*', 'w*')} differ in shape: {err}"
            ) from None
        yield f"{prefix}.gate_up_proj", gate_up
        yield f"{prefix}.down_proj", down


def _expert_name(source: str, e, w) -> str:
    """The source spelling of expert e's weight w, from the spelling of one of its siblings."""
    return re.sub(r"\.\d+\.w[123]\.weight$", f".{e}.{w}.weight", source)


def ours_to_native(tensors):
    """(name, tensor) in our naming -> Moonshot's (what transformers' kimi_linear loads)."""
    for name, t in tensors:
        if name.endswith(".self_attn.A_log"):
            yield name, t.reshape(1, 1, -1, 1)
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")].replace(".mlp.", ".block_sparse_moe.")
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                yield f"{prefix}.{e}.w1.weight", gate.contiguous()
                yield f"{prefix}.{e}.w3.weight", up.contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")].replace(".mlp.", ".block_sparse_moe.")
            for e, w in enumerate(t):
                yield f"{prefix}.{e}.w2.weight", w.contiguous()
        else:
            yield name, t


def cast(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """--dtype for one tensor: floating tensors are cast, except those the model keeps in float32
    (`fp32.kimi_linear_fp32`), which stay as the source stores them."""
    if dtype is None or not t.is_floating_point() or keeps_fp32(name, kimi_linear_fp32()):
        return t
    return t.to(dtype)


def copy_side_files(src: str, writer: ShardedWriter, config: dict | None = None) -> bool:
    """Copies generation config and tokenizer files next to the weights; Kimi's tiktoken files also
    become a fast tokenizer.json. With a tokenizer that has Kimi's chat markup, the generation config
    (written from `config`'s token ids when the source has none) stops at the end of a turn too.
    Returns whether the tokenizer conversion happened."""
    for extra in EXTRA_FILES:
        if os.path.exists(os.path.join(src, extra)):
            writer.copy(os.path.join(src, extra))
    converted = convert_tokenizer_dir(src, writer.tmp)
    if os.path.exists(os.path.join(writer.tmp, "tokenizer.json")):
        stop_generation_at_turn_end(writer.tmp, config)
    return converted


def convert_config(cfg: dict) -> dict:
    """config.json of one side -> the other's."""
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "auto_map", "transformers_version")}
    if cfg.get("model_type") == NATIVE:
        from kimi_hf import KimiHybridTextConfig

        cfg.pop("model_type")
        for a, b in _NATIVE_RENAMES.items():
            if a in cfg:
                cfg[b] = cfg.pop(a)
        out = KimiHybridTextConfig(**cfg).to_dict()
        out["architectures"] = ["KimiHybridForCausalLM"]
        return out
    if cfg.get("model_type") == OURS:
        out = {k: v for k, v in cfg.items() if k not in ("router_aux_loss_coef", "mla_use_nope")}
        out["model_type"] = NATIVE
        for a, b in _NATIVE_RENAMES.items():
            if b in out:
                out[a] = out.pop(b)
        out["architectures"] = ["KimiLinearForCausalLM"]
        return out
    raise ValueError(
        f"config.json has model_type {cfg.get('model_type')!r}: not a Kimi Linear checkpoint "
        f"(expected {NATIVE!r} or {OURS!r})"
    )


def expected_shapes(our_config: dict) -> dict[str, tuple[int, ...]]:
    """Our tensor names and shapes for a config (a model built on the meta device: no memory)."""
    from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig

    cfg = KimiHybridTextConfig(**{k: v for k, v in our_config.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = KimiHybridForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _groups(names: list[str]) -> list[list[str]]:
    """Tensor names grouped by decoder layer (non-layer tensors first), layers in order."""
    by_layer = defaultdict(list)
    for n in names:
        m = _LAYER.match(n)
        by_layer[int(m.group(1)) if m else -1].append(n)
    return [by_layer[k] for k in sorted(by_layer)]


def convert(
    src: str, dst: str, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB", show_progress: bool = True
) -> dict:
    """Converts checkpoint directory src into dst (must not exist), streaming. Returns a summary
    {"model_type", "shards", "tensors", "peak_rss_mb", "largest_tensor_mb"}."""
    cfg = read_config(src)
    new_cfg = convert_config(cfg)  # refuses another architecture before any tensor is read
    reader = CheckpointReader(src)
    to_ours = cfg["model_type"] == NATIVE
    ours_cfg = new_cfg if to_ours else cfg
    expected = expected_shapes(ours_cfg)
    largest = 0
    with ShardedWriter(dst, max_shard_size) as writer:
        groups = _groups(reader.names())
        for names in progress(groups, len(groups), "converting", show_progress):
            # checked as the checkpoint spells them, before any renaming: errors name the user's tensor
            checked = check_source(((n, reader.get(n)) for n in names), expected, reader, native=to_ours)
            out = (
                native_to_ours(checked, ours_cfg["linear_num_heads"], ours_cfg["num_experts"])
                if to_ours
                else ours_to_native(checked)
            )
            for name, t in out:
                t = cast(name, t, dtype)
                largest = max(largest, t.numel() * t.element_size())
                writer.add(name, t)
        check_complete(_seen_ours(writer.seen, to_ours), expected, reader, native=to_ours)
        if dtype is not None:
            new_cfg["dtype"] = str(dtype).removeprefix("torch.")
        writer.write_json("config.json", new_cfg)
        fast_tokenizer = copy_side_files(src, writer, new_cfg)
        shards = writer.finish()
    return {
        "model_type": new_cfg["model_type"],
        "shards": len(shards),
        "tensors": len(writer.seen),
        "peak_rss_mb": peak_rss_mb(),
        "largest_tensor_mb": largest / 2**20,
        "fast_tokenizer": fast_tokenizer,
    }


def _source_shapes(name: str, expected: dict, native: bool) -> list[tuple[int, ...]]:
    """The shapes a source tensor may have ([]: not part of the config); expected is in our naming."""
    if not native:
        return [expected[name]] if name in expected else []
    ours = _normalize(name)
    if (m := _EXPERT.match(ours)) is not None:
        gate_up, down = expected.get(f"{m.group(1)}.gate_up_proj"), expected.get(f"{m.group(1)}.down_proj")
        if gate_up is None or down is None or int(m.group(2)) >= gate_up[0]:
            return []
        return [down[1:] if m.group(3) == "w2" else (gate_up[1] // 2, *gate_up[2:])]
    if ours.endswith(".self_attn.A_log") and ours in expected:
        (heads,) = expected[ours]
        return [(1, 1, heads, 1), (heads,)]  # Moonshot's layout, ours
    if ours.endswith(".self_attn.conv1d.weight"):  # q, k, v stacked
        parts = [expected.get(ours.replace("conv1d", f"{p}_conv1d")) for p in "qkv"]
        if None in parts or len({p[1:] for p in parts}) != 1:
            return []
        return [(sum(p[0] for p in parts), *parts[0][1:])]
    return [expected[ours]] if ours in expected else []


def check_source(tensors, expected: dict, reader: CheckpointReader, native: bool):
    """Passes (name, tensor) as the checkpoint spells them through, refusing names that are not part of
    the config and wrong shapes; the error names the tensor and its file. expected: our names and
    shapes (`expected_shapes`); native: the source uses Moonshot's / transformers' naming."""
    claimed = {}  # what a source tensor becomes -> its name: two spellings of one tensor are refused
    for name, t in tensors:
        shapes = _source_shapes(name, expected, native)
        where = f"{name} (in {os.path.join(reader.path, reader.file_of(name))})"
        if not shapes:
            raise ValueError(
                f"unknown tensor {where}: not part of this Kimi Linear config; a checkpoint of "
                "another architecture or a mismatched config.json?"
            )
        if tuple(t.shape) not in shapes:
            raise ValueError(
                f"tensor {where} has shape {tuple(t.shape)}, the config implies {' or '.join(map(str, shapes))}"
            )
        ours = _normalize(name) if native else name
        stacked = ours.endswith(".self_attn.conv1d.weight")
        for target in [ours.replace("conv1d", f"{p}_conv1d") for p in "qkv"] if stacked else [ours]:
            if target in claimed:
                raise ValueError(
                    f"tensors {claimed[target]} and {where} are the same tensor in two namings: "
                    "a checkpoint that mixes namings?"
                )
            claimed[target] = where
        yield name, t


def source_spelling(name: str, expected: dict, source_names: list[str]) -> list[str]:
    """Our tensor name -> its name(s) in a native checkpoint spelled like source_names (Moonshot's
    block_sparse_moe and per-expert w1/w2/w3, or transformers' in-memory layout)."""
    moe = ".block_sparse_moe." if any(".block_sparse_moe." in n for n in source_names) else ".mlp."
    if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and not any(
        n.endswith(".experts.gate_up_proj") for n in source_names
    ):
        prefix, kind = name.rsplit(".", 1)
        prefix = prefix.replace(".mlp.", moe)
        return [
            f"{prefix}.{e}.{w}.weight"
            for e in range(expected[name][0])
            for w in (("w1", "w3") if kind == "gate_up_proj" else ("w2",))
        ]
    name = name.replace(".mlp.", moe)
    if re.search(r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)\b", name) and any(
        ".self_attn.forget_gate." in n for n in source_names
    ):
        name = name.replace(".self_attn.", ".self_attn.forget_gate.")
    if re.search(r"\.self_attn\.[qkv]_conv1d\.", name) and any(
        n.endswith(".self_attn.conv1d.weight") for n in source_names
    ):
        name = re.sub(r"[qkv]_conv1d", "conv1d", name)
    return [name]


def check_complete(written: set[str], expected: dict, reader: CheckpointReader, native: bool) -> None:
    """Refuses a conversion that did not produce every tensor of the config; the error names the
    missing tensors as the checkpoint would spell them. written, expected: our names."""
    missing = sorted(set(expected) - written)
    if not missing:
        return
    names = reader.names()
    spelled = list(dict.fromkeys(n for m in missing for n in (source_spelling(m, expected, names) if native else [m])))
    raise ValueError(f"{len(spelled)} tensors are missing from {reader.path}, e.g. {spelled[:5]}")


def _seen_ours(written: set[str], to_ours: bool) -> set[str]:
    """Our names of what was written (the native names of stacked experts and A_log map back)."""
    if to_ours:
        return written
    out = set()
    for n in written:
        if m := re.match(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.\d+\.(w1|w3|w2)\.weight$", n):
            out.add(f"{m.group(1)}.mlp.experts.{'down_proj' if m.group(2) == 'w2' else 'gate_up_proj'}")
        else:
            out.add(n)
    return out


def verify(src: str, dst: str, layers: int = 2, atol: float = 1e-3) -> float:
    """--verify (`verify.compare_logits`): src and dst, their first `layers` decoder layers (0 = all; the
    rule is verify.verify_layer_count's), each with its own class, in a fresh process. Returns the max abs
    difference of the logits relative to the largest logit; raises if it exceeds atol (a tolerance: one side
    may be transformers' implementation, the other ours)."""
    diff = compare_logits(src, dst, layers)["rel_max_diff"]
    if not diff <= atol:
        raise ValueError(f"logits of {src} and {dst} differ by {diff:.2e} (relative), more than {atol}")
    return diff


__all__ = [
    "convert",
    "verify",
    "convert_config",
    "native_to_ours",
    "ours_to_native",
    "expected_shapes",
    "check_source",
    "check_complete",
    "source_spelling",
]
