"""Load-time conversion of Moonshot's original Kimi Linear layout into ours.

`KimiHybridForCausalLM.from_pretrained(folder)` (and `KimiHybridTextModel`'s) of a Kimi-Linear-48B
style folder, in Moonshot's naming (which transformers' own `save_pretrained` of KimiLinearForCausalLM
writes too), converts the tensors while they load, through transformers' checkpoint conversion
mapping (`register_checkpoint_conversion_mapping`):

    *.block_sparse_moe.*                                -> *.mlp.*
    mlp.experts.{e}.w1.weight, .w3.weight  [I, H] each  -> mlp.experts.gate_up_proj [E, 2I, H] (w1 = gate rows first)
    mlp.experts.{e}.w2.weight              [H, I] each  -> mlp.experts.down_proj [E, H, I]
    self_attn.A_log                        [1, 1, H, 1] -> self_attn.A_log [H]

and, for a state dict of transformers' in-memory kimi_linear layout (e.g. `save_file(model.state_dict())`):

    self_attn.forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log} -> self_attn.*
    self_attn.conv1d.weight (q, k, v stacked on dim 0)         -> self_attn.{q,k,v}_conv1d.weight

The same names as kimi_hf.conversion.kimi_linear (the offline converter, which stays for streaming,
dtype and sharding jobs and checks every name and shape first). A checkpoint in our own layout matches
none of these (A_log [H] goes through the reshape unchanged).

Under tensor parallelism transformers cuts each checkpoint tensor before these transforms run, by the target
parameter's placements along the stored tensor's first dim: FitALog and ChunkStacked gather what that cut gets
wrong (A_log stored in another shape, stacked convs) and keep this rank's part.

The transforms are load-only: `save_pretrained` writes our layout (what the offline converter writes),
whether the model was loaded from Moonshot's layout, from ours or built from a config. transformers'
default would write the source layout back (`save_original_format=True`), which next to our
config.json would be neither checkpoint.

The mapping is registered under the class name of the text decoder (`KimiHybridTextModel`), not a
model_type: a folder of Moonshot's says model_type "kimi_linear" (which our config instance keeps),
and transformers skips custom-code models unless their class name or model_type was registered. The
text decoder is a submodule of KimiHybridForCausalLM (scoped to all of its keys) and of the multimodal
model (scoped to its `language_model`), so one registration covers all three.

This folder is copied flat into Hub repos: imports are torch, transformers and the stdlib only.
"""

import re

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Chunk,
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)


REGISTERED_CLASS = "KimiHybridTextModel"

# Moonshot's MoE block and per-expert weights (released) -> ours: the stacked experts parameter each expert weight
# goes into, its parts in row order (gate_up_proj [E, 2I, H] holds w1 = gate rows, then w3 = up rows)
MOE_BLOCK = ("block_sparse_moe", "mlp")
EXPERT_WEIGHTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

# Moonshot's MoonViT tensor names (the K2.5 and K3 releases) -> this tower's, relative to the tower's root; {i} is a
# block index. The one declaration of the names: load-time renames (`moonvit_key_mapping`), the save in K3's
# layout and the offline K2.5 converter derive theirs from it (`rename_pairs`).
MOONVIT_NAMES = (
    ("patch_embed.pos_emb.weight", "patch_embed.pos_emb.position_embeddings"),
    ("encoder.blocks.{i}.norm0.", "layers.{i}.norm1."),
    ("encoder.blocks.{i}.norm1.", "layers.{i}.norm2."),
    ("encoder.blocks.{i}.wqkv.", "layers.{i}.attn.qkv_proj."),
    ("encoder.blocks.{i}.wo.", "layers.{i}.attn.proj."),
    ("encoder.blocks.{i}.mlp.fc0.", "layers.{i}.mlp.fc1."),
    ("encoder.blocks.{i}.mlp.fc1.", "layers.{i}.mlp.fc2."),
    ("encoder.final_layernorm.", "final_layernorm."),
)


def rename_pairs(table, reverse: bool = False) -> list[tuple[str, str]]:
    """(regex source, replacement) pairs of a (released, ours) name table with `{i}` index fields: released -> ours,
    or ours -> released with reverse=True. Sources are anchored at the start and match name prefixes."""
    pairs = []
    for released, ours in table:
        src, tgt = (ours, released) if reverse else (released, ours)
        pattern = "^" + re.escape(src).replace(re.escape("{i}"), r"(\d+)")
        pairs.append((pattern, tgt.replace("{i}", r"\1")))
    return pairs


class _NoReverse(WeightRenaming):
    """The reverse of a load-only transform: matches nothing, so saving keeps our names and shapes."""

    __slots__ = ()

    def __init__(self, source_patterns="", target_patterns=""):
        super().__init__(source_patterns=r"^(?!)", target_patterns="")

    def rename_source_key(self, source_key: str):
        return source_key, None

    def reverse_transform(self):
        return self


class LoadOnlyRenaming(WeightRenaming):
    """A WeightRenaming applied by from_pretrained and not reverted by save_pretrained."""

    __slots__ = ()

    def reverse_transform(self):
        return _NoReverse()


class LoadOnlyConverter(WeightConverter):
    """A WeightConverter applied by from_pretrained and not reverted by save_pretrained."""

    __slots__ = ()

    def reverse_transform(self):
        return _NoReverse()


class Flatten(ConversionOps):
    """One tensor reshaped to 1-D: Moonshot's A_log [1, 1, H, 1] -> ours [H] (a [H] one is unchanged), K3's
    Attention Residual projections [1, d] -> the queries [d]. A wrong size then shows as a size mismatch of the
    parameter, naming it. Under sharding (tensor parallelism, FSDP2 at load) the loader has cut the stored tensor
    on its own size-1 first dim (all on rank 0): the slices are gathered back first and this rank's part cut."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        if len(input_dict) != 1:
            raise ValueError(f"Flatten takes one tensor, got {list(input_dict)}")
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        param = _target_param(model, full_layer_name)
        sharded = _placements(param)
        if sharded is not None:
            whole = _gather_loaded(tensor, param.shape, *sharded)
            if whole is None:  # stored in the parameter's shape: the loader's cut is the parameter's
                return {target_patterns[0]: tensor}
            whole = whole.reshape(-1)
            if whole.numel() == param.numel():
                return {target_patterns[0]: _local_part(whole, param, *sharded)}
            return {target_patterns[0]: whole}  # a size mismatch, reported by name
        return {target_patterns[0]: tensor.reshape(-1)}

    @property
    def reverse_op(self):
        raise NotImplementedError("Flatten is load-only: the reverse needs the source shape")


def _target_param(model, full_layer_name):
    """The model's parameter a conversion fills (a DTensor's shape is the global one), or None."""
    if model is None or full_layer_name is None:
        return None
    try:
        return model.get_parameter(full_layer_name)
    except AttributeError:
        return None


def _placements(param):
    """(device mesh, placements) of a DTensor parameter (tensor parallelism), else None."""
    if param is None or not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return (param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None


def _gather_loaded(local: torch.Tensor, param_shape, mesh, placements) -> torch.Tensor | None:
    """Under tensor parallelism transformers' loader cuts each checkpoint tensor by its parameter's placements
    along the *checkpoint tensor's* dim 0 before any conversion runs: right for a tensor of the parameter's shape,
    wrong for A_log stored [head_dim] (K3: rank 1 of 2 gets entries 64..127, half of them padding, instead of heads
    48..95), [1, 1, H, 1] (all on rank 0) or stacked q/k/v convs. Returns None when the stored tensor has the
    parameter's shape (the cut is the parameter's), else the whole stored tensor, gathered from every rank's slice
    (a collective: every rank converts every key, in the same order). The sizes are summed over the mesh first,
    so the cut may be uneven."""
    from torch.distributed.tensor import DTensor

    size = torch.tensor([local.shape[0]], dtype=torch.int64, device=local.device)
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            torch.distributed.all_reduce(size, group=mesh.get_group(dim))
    shape = (int(size), *local.shape[1:])
    if shape == tuple(param_shape):
        return None
    stride = tuple(int(torch.Size(shape[i + 1 :]).numel()) for i in range(len(shape)))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride).full_tensor()


def _local_part(full: torch.Tensor, param, mesh, placements) -> torch.Tensor:
    """This rank's slice of a whole tensor of param's global shape, as param's placements cut it."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].clone()


class ChunkStacked(Chunk):
    """transformers' Chunk (one stacked tensor -> equal parts, e.g. q/k/v short convs on dim 0), safe under tensor
    parallelism: the loader has cut the stacked tensor by the placements of the *first* target (rank 0 of 2 would
    get q and half of k), so its slices are gathered back first and each part cut by its own parameter."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        param = _target_param(model, full_layer_name)
        sharded = _placements(param)
        if sharded is None or self.dim != 0:
            return super().convert(input_dict, source_patterns, target_patterns, **kwargs)
        tensors = next(iter(input_dict.values()))
        whole = _gather_loaded(tensors[0] if isinstance(tensors, list) else tensors, param.shape, *sharded)
        if whole is None:  # not stacked after all: the size mismatch is reported by name
            return super().convert(input_dict, source_patterns, target_patterns, **kwargs)
        parts = whole.chunk(len(target_patterns))
        return {t: _local_part(part, param, *sharded) for t, part in zip(target_patterns, parts)}


class FitALog(ConversionOps):
    """A_log to the model's [H]: Moonshot's Kimi Linear [1, 1, H, 1] is reshaped; Kimi K3's release stores
    [head_dim] with the H heads first and zeros after (K3: 96 of 128), which is narrowed to H. Padding that is
    not zero is refused by name (it would be heads the model does not have). Under tensor parallelism the
    loader's slices of a stored tensor of another shape are gathered first (_gather_loaded) and this rank's heads
    cut from the result."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        if len(input_dict) != 1:
            raise ValueError(f"FitALog takes one tensor, got {list(input_dict)}")
        tensors = next(iter(input_dict.values()))
        stored = tensors[0] if isinstance(tensors, list) else tensors
        param = _target_param(model, full_layer_name)
        heads = None if param is None else param.shape[0]
        head_dim = None if model is None else getattr(model.config.get_text_config(), "linear_head_dim", None)
        sharded = _placements(param)
        if sharded is not None:
            whole = _gather_loaded(stored, param.shape, *sharded)
            if whole is None:
                return {target_patterns[0]: stored}
            stored = whole
        tensor = stored.reshape(-1)
        # only K3's layout (1-D, head_dim long) is padded; another count of heads stays a size mismatch, by name
        if heads is not None and stored.ndim == 1 and tensor.numel() == head_dim and head_dim > heads:
            if tensor[heads:].count_nonzero():
                raise ValueError(
                    f"{full_layer_name}: the checkpoint's A_log has {tensor.numel()} entries and the model {heads} "
                    "heads, but entries beyond the heads are not zero padding"
                )
            tensor = tensor[:heads].clone()
        if sharded is not None and tensor.numel() == heads:
            tensor = _local_part(tensor, param, *sharded)
        return {target_patterns[0]: tensor}

    @property
    def reverse_op(self):
        raise NotImplementedError("FitALog is load-only")


def kimi_linear_mapping() -> list:
    """The transforms, in transformers' order: every renaming first, then at most one converter per key."""
    return [
        # transformers' in-memory layout keeps the gate's tensors in a forget_gate submodule
        LoadOnlyRenaming(source_patterns=r"\.self_attn\.forget_gate\.", target_patterns=".self_attn."),
        # Moonshot's MoE block (and the dense layer 0, in transformers' save_pretrained spelling)
        LoadOnlyRenaming(source_patterns=rf"\.{MOE_BLOCK[0]}\.", target_patterns=f".{MOE_BLOCK[1]}."),
        LoadOnlyConverter(
            source_patterns=r"self_attn\.A_log", target_patterns="self_attn.A_log", operations=[FitALog()]
        ),
        # transformers' in-memory layout stacks the three short convolutions
        LoadOnlyConverter(
            source_patterns=r"self_attn\.conv1d\.weight",
            target_patterns=["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"],
            operations=[ChunkStacked(dim=0)],
        ),
        # per-expert SwiGLU weights stacked: [E, 2I, H] with gate (w1) rows before up (w3) rows, [E, H, I]
        *(
            LoadOnlyConverter(
                source_patterns=[f"mlp.experts.*.{w}.weight" for w in parts],
                target_patterns=f"mlp.experts.{stacked}",
                operations=[MergeModulelist(dim=0), Concatenate(dim=1)]
                if len(parts) > 1
                else [MergeModulelist(dim=0)],
            )
            for stacked, parts in EXPERT_WEIGHTS.items()
        ),
    ]


def moonvit_key_mapping() -> list[tuple[str, str]]:
    """Kimi K3's released vision-tower tensor names -> this tower's parameter names, as (regex source, target)
    pairs relative to the tower's root (the release's `vision_tower.`; ours `vision_tower.` inside the
    multimodal model, e.g. `model.vision_tower.`), for a tower built with rope_type "interleaved_2d"
    (KimiK3VisionConfig):

        patch_embed.proj.weight         [C, 3, p, p]     the same name (no entry)
        patch_embed.pos_emb.weight      [H, W, C]        -> patch_embed.pos_emb.position_embeddings
        encoder.blocks.{i}.norm0.*      [C]              -> layers.{i}.norm1.*
        encoder.blocks.{i}.norm1.*      [C]              -> layers.{i}.norm2.*
        encoder.blocks.{i}.wqkv.*       [3 qkv, C]       -> layers.{i}.attn.qkv_proj.*
        encoder.blocks.{i}.wo.*         [C, qkv]         -> layers.{i}.attn.proj.*
        encoder.blocks.{i}.mlp.fc0.*    [I, C]           -> layers.{i}.mlp.fc1.*
        encoder.blocks.{i}.mlp.fc1.*    [C, I]           -> layers.{i}.mlp.fc2.*
        encoder.final_layernorm.*       [C]              -> final_layernorm.*

    Every tensor is a pure rename (no split, no row permutation: the interleaved RoPE reads wqkv's q/k rows in
    their released order), so the reverse pairs write the released names back on save. The projector
    (`mm_projector.` in the release) needs no entry: KimiHybridMultimodalProjectorV2's parameters are named
    proj.0.weight, proj.2.weight and post_norm.weight as released. Sources are anchored (`^`) and no target
    matches another source, so applying the pairs one after another (transformers' WeightRenaming does) renames
    each key once; the non-persistent buffers (time embedding, freqs_cis) are not stored in either layout."""
    return rename_pairs(MOONVIT_NAMES)


def register() -> None:
    """Registers the mappings with transformers (idempotent: a second call replaces them with equal ones)."""
    register_checkpoint_conversion_mapping(REGISTERED_CLASS, kimi_linear_mapping(), overwrite=True)


__all__ = [
    "REGISTERED_CLASS",
    "ChunkStacked",
    "FitALog",
    "Flatten",
    "LoadOnlyConverter",
    "LoadOnlyRenaming",
    "EXPERT_WEIGHTS",
    "MOE_BLOCK",
    "MOONVIT_NAMES",
    "kimi_linear_mapping",
    "rename_pairs",
    "moonvit_key_mapping",
    "register",
]
