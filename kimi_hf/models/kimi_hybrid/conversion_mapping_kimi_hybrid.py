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


def kimi_linear_mapping() -> list:
    """The transforms, in transformers' order: every renaming first, then at most one converter per key."""
    return [
        # transformers' in-memory layout keeps the gate's tensors in a forget_gate submodule
        LoadOnlyRenaming(source_patterns=r"\.self_attn\.forget_gate\.", target_patterns=".self_attn."),
        # Moonshot's MoE block (and the dense layer 0, in transformers' save_pretrained spelling)
        LoadOnlyRenaming(source_patterns=r"\.block_sparse_moe\.", target_patterns=".mlp."),
        LoadOnlyConverter(
            source_patterns=r"self_attn\.A_log", target_patterns="self_attn.A_log", operations=[Flatten()]
        ),
        # transformers' in-memory layout stacks the three short convolutions
        LoadOnlyConverter(
            source_patterns=r"self_attn\.conv1d\.weight",
            target_patterns=["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"],
            operations=[Chunk(dim=0)],
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


def register() -> None:
    """Registers the mapping with transformers (idempotent: a second call replaces it with an equal one)."""
    register_checkpoint_conversion_mapping(REGISTERED_CLASS, kimi_linear_mapping(), overwrite=True)


__all__ = ["REGISTERED_CLASS", "Flatten", "LoadOnlyConverter", "LoadOnlyRenaming", "kimi_linear_mapping", "register"]
