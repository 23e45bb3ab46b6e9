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
# only the root class: a nested KimiK3Model with its own registration would apply the transforms twice
K3_REGISTERED_CLASSES = ("KimiK3ForConditionalGeneration", "KimiK3Model")


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
    """One tensor reshaped to 1-D: Moonshot's A_log [1, 1, H, 1] -> ours [H] (a [H] one is unchanged).
    A wrong head count then shows as a size mismatch of the parameter, naming it."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        if len(input_dict) != 1:
            raise ValueError(f"Flatten takes one tensor, got {list(input_dict)}")
        tensors = next(iter(input_dict.values()))
        tensor = tensors[0] if isinstance(tensors, list) else tensors
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


def _as_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """transformers' loader casts every checkpoint tensor to its target parameter's dtype before the conversion
    ops run; uint8 values survive any float cast exactly (0..255 are exact even in bf16), so they are cast back."""
    if t.dtype == torch.uint8 or not t.is_floating_point():
        return t
    back = t.to(torch.uint8)
    if not torch.equal(back.to(t.dtype), t):
        raise ValueError(f"{name}: MXFP4 tensors must hold uint8 values, got non-byte {t.dtype} values")
    return back


class DequantizeMxfp4(ConversionOps):
    """Kimi K3's MXFP4 routed experts (compressed-tensors mxfp4-pack-quantized) to the model's stacked experts
    tensor, losslessly, in one pass: each expert's `*.weight_packed` [out, in/2] uint8 with its `*.weight_scale`
    [out, in/32] is decoded straight into its slice of the target [E, sum of outs, in] (w1 rows then w3 rows for
    gate_up_proj, as the source patterns are ordered; w2 alone for down_proj), so one layer's experts exist once
    in the model's dtype while they load (no stacked copy, no concatenation copy)."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **kwargs):
        from .mxfp4_kimi_hybrid import dequantize_mxfp4

        dtype = torch.bfloat16
        if model is not None and full_layer_name is not None:
            try:
                dtype = model.get_parameter(full_layer_name).dtype
            except AttributeError:
                pass
        parts = []  # (pattern, packed list, scale list)
        for pattern in source_patterns:
            if not pattern.endswith("weight_packed"):
                continue
            packed = input_dict.pop(pattern, None)
            scales = input_dict.pop(pattern.replace("weight_packed", "weight_scale"), None)
            if packed is None or scales is None:
                raise ValueError(f"{full_layer_name}: {pattern} and its weight_scale must both be in the checkpoint")
            packed = packed if isinstance(packed, list) else [packed]
            scales = scales if isinstance(scales, list) else [scales]
            if len(scales) != len(packed):
                raise ValueError(
                    f"{full_layer_name}: {len(packed)} {pattern} tensors but {len(scales)} weight_scale tensors"
                )
            parts.append((pattern, packed, scales))
        if input_dict:
            raise ValueError(f"{full_layer_name}: unexpected tensors beside the MXFP4 experts: {list(input_dict)}")
        experts = {len(packed) for _, packed, _ in parts}
        if len(experts) != 1:
            raise ValueError(
                f"{full_layer_name}: the MXFP4 tensors disagree on the number of experts: {sorted(experts)}"
            )
        E = experts.pop()
        rows = [packed[0].shape[-2] for _, packed, _ in parts]
        cols = {2 * packed[0].shape[-1] for _, packed, _ in parts}
        if len(cols) != 1:
            raise ValueError(f"{full_layer_name}: the MXFP4 tensors disagree on the input width: {sorted(cols)}")
        out = torch.empty(E, sum(rows), cols.pop(), dtype=dtype, device=parts[0][1][0].device)
        start = 0
        for (pattern, packed, scales), n in zip(parts, rows):
            name = f"{full_layer_name} ({pattern})"
            for e in range(E):
                p, s = _as_bytes(packed[e], name), _as_bytes(scales[e], name)
                if p.shape[-2] != n:
                    raise ValueError(f"{name}[{e}]: {p.shape[-2]} rows, expert 0 has {n}")
                out[e, start : start + n] = dequantize_mxfp4(p, s, dtype=dtype, name=f"{name}[{e}]")
                packed[e] = scales[e] = None  # the source bytes go as soon as they are decoded
            start += n
        return {target_patterns[0]: out}

    @property
    def reverse_op(self):
        raise NotImplementedError("DequantizeMxfp4 is load-only (save_pretrained of a K3 model re-packs)")


def kimi_linear_mapping() -> list:
    """The transforms, in transformers' order: every renaming first, then at most one converter per key."""
    return [
        # transformers' in-memory layout keeps the gate's tensors in a forget_gate submodule
        LoadOnlyRenaming(source_patterns=r"\.self_attn\.forget_gate\.", target_patterns=".self_attn."),
        # Moonshot's MoE block (and the dense layer 0, in transformers' save_pretrained spelling)
        LoadOnlyRenaming(source_patterns=r"\.block_sparse_moe\.", target_patterns=".mlp."),
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
        LoadOnlyConverter(
            source_patterns=["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        LoadOnlyConverter(
            source_patterns="mlp.experts.*.w2.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]


def k3_mapping() -> list:
    """Kimi K3's released layout -> KimiK3ForConditionalGeneration (K3.md-style names on the left):

        language_model.model.*            -> model.language_model.*       language_model.lm_head.* -> lm_head.*
        vision_tower.* / mm_projector.*   -> model.vision_tower.* (renames of k3_vision_key_mapping) / model.mm_projector.*
        *.self_attention_res_{norm,proj}  -> *.attn_res.{key_norm.weight, query}  ([1, d] proj -> [d] query)
        *.mlp_res_{norm,proj}             -> *.mlp_res.*;   output_attn_res_* -> final_res.*
        block_sparse_moe.experts.{e}.w1/w3/w2 (.weight_packed + .weight_scale MXFP4, or bf16 .weight)
                                          -> mlp.experts.gate_up_proj [E, 2I, latent] / down_proj [E, latent, I]
        self_attn.A_log [head_dim], zero-padded -> [H]
    plus Kimi Linear's other transforms (block_sparse_moe -> mlp)."""
    from .modeling_kimi_hybrid_vision import k3_vision_key_mapping

    vision = [
        LoadOnlyRenaming(
            source_patterns=r"^vision_tower\." + src.removeprefix("^"), target_patterns="model.vision_tower." + tgt
        )
        for src, tgt in k3_vision_key_mapping()
    ]
    res = []
    for released, ours in (
        ("self_attention_res", "attn_res"),
        ("mlp_res", "mlp_res"),
        ("output_attn_res", "final_res"),
    ):
        res.append(
            LoadOnlyRenaming(
                source_patterns=rf"\.{released}_norm\.weight$", target_patterns=f".{ours}.key_norm.weight"
            )
        )
        res.append(LoadOnlyRenaming(source_patterns=rf"\.{released}_proj\.weight$", target_patterns=f".{ours}.query"))
    linear = kimi_linear_mapping()
    renames = [t for t in linear if isinstance(t, WeightRenaming)]
    converters = [t for t in linear if not isinstance(t, WeightRenaming)]
    mxfp4 = [
        LoadOnlyConverter(
            source_patterns=[
                "mlp.experts.*.w1.weight_packed",
                "mlp.experts.*.w1.weight_scale",
                "mlp.experts.*.w3.weight_packed",
                "mlp.experts.*.w3.weight_scale",
            ],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[DequantizeMxfp4()],
        ),
        LoadOnlyConverter(
            source_patterns=["mlp.experts.*.w2.weight_packed", "mlp.experts.*.w2.weight_scale"],
            target_patterns="mlp.experts.down_proj",
            operations=[DequantizeMxfp4()],
        ),
    ]
    query = [
        LoadOnlyConverter(source_patterns=rf"{ours}\.query", target_patterns=f"{ours}.query", operations=[Flatten()])
        for ours in ("attn_res", "mlp_res", "final_res")
    ]
    return [
        *vision,
        LoadOnlyRenaming(source_patterns=r"^vision_tower\.", target_patterns="model.vision_tower."),
        LoadOnlyRenaming(source_patterns=r"^mm_projector\.", target_patterns="model.mm_projector."),
        LoadOnlyRenaming(source_patterns=r"^language_model\.model\.", target_patterns="model.language_model."),
        LoadOnlyRenaming(source_patterns=r"^language_model\.lm_head\.", target_patterns="lm_head."),
        *res,
        *renames,
        *query,
        *mxfp4,
        *converters,
    ]


def register() -> None:
    """Registers the mappings with transformers (idempotent: a second call replaces them with equal ones)."""
    register_checkpoint_conversion_mapping(REGISTERED_CLASS, kimi_linear_mapping(), overwrite=True)


def register_k3() -> None:
    """Registers K3's mapping for its multimodal classes (called by modeling_kimi_k3 at import)."""
    for name in K3_REGISTERED_CLASSES:
        register_checkpoint_conversion_mapping(name, k3_mapping(), overwrite=True)


__all__ = [
    "REGISTERED_CLASS",
    "K3_REGISTERED_CLASSES",
    "ChunkStacked",
    "DequantizeMxfp4",
    "FitALog",
    "Flatten",
    "LoadOnlyConverter",
    "LoadOnlyRenaming",
    "k3_mapping",
    "kimi_linear_mapping",
    "register",
    "register_k3",
]
