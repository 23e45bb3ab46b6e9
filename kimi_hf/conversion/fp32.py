"""The tensors the converters keep in float32 whatever --dtype says: the one declaration, for every format.

The source is the model's own list, `KimiHybridPreTrainedModel._keep_in_fp32_modules_strict` (modeling_kimi_hybrid.py;
Kimi K3's classes inherit it): the tensors from_pretrained(dtype=bfloat16 / float16) and model.to(dtype) keep in
fp32, because rounding them changes what the model computes. A converter that rounded one of them would lose
precision that the loaded model then uses. Why each entry is fp32:

    A_log, dt_bias               the parameters of KDA's gate (kimi_hf.ops.kda_inputs.kda_gate): a decay near 1
                                 rounded to bf16 is 1, a channel that never forgets
    q_conv1d, k_conv1d, v_conv1d KDA's short convolutions, computed in fp32 (Kimi Linear and K3 store them F32)
    o_norm                       KDA's gated output norm, computed in fp32 (K3 stores its weight F32)
    e_score_correction_bias      the router's expert-choice bias: bf16's steps reorder experts whose scores are close
    gate.weight                  the router's weight: fp32 logits, so that rounding does not move tokens to other
                                 experts

Per format (`keeps_fp32(name, kimi_linear_fp32())`, `keeps_fp32(name, k3_fp32())`):

- `kimi_linear_fp32` (kimi-linear both ways, k25-vision's text tensors): the whole list. These tensors are left as the
  source stores them (not cast), in our naming and in Moonshot's / transformers' (whose own kimi_linear keeps a
  subset: e_score_correction_bias, gate.weight, dt_bias).
- `k3_fp32` (`kimi-hf convert k3`): the list but the router's `gate.weight`, i.e. exactly the tensors the K3 release
  stores in F32; they are written F32. The release stores its router weight in the model's dtype (as
  modeling_kimi_k3.k3_state_dict saves it), the model upcasts it when it loads, so it follows --dtype.

The list is read from the modeling file's source, not imported: K3's planning and `--help` stay free of torch.
"""

from __future__ import annotations

import ast
import functools
import os


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODEL_FILE = os.path.join(_PACKAGE, "models", "kimi_hybrid", "modeling_kimi_hybrid.py")
_MODEL_CLASS, _ATTRIBUTE = "KimiHybridPreTrainedModel", "_keep_in_fp32_modules_strict"
# the K3 release's router weight is stored in the model's dtype (see the docstring)
_K3_MODEL_DTYPE = ("gate.weight",)


@functools.cache
def model_fp32_modules() -> tuple[str, ...]:
    """`KimiHybridPreTrainedModel._keep_in_fp32_modules_strict`, read from modeling_kimi_hybrid.py's source."""
    with open(_MODEL_FILE, encoding="utf-8") as f:
        tree = ast.parse(f.read(), _MODEL_FILE)
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and cls.name == _MODEL_CLASS:
            for node in cls.body:
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == _ATTRIBUTE for t in node.targets):
                    return tuple(ast.literal_eval(node.value))
    raise RuntimeError(f"internal error: {_MODEL_FILE} has no {_MODEL_CLASS}.{_ATTRIBUTE}")


def kimi_linear_fp32() -> tuple[str, ...]:
    """The entries kept for the Kimi Linear / hybrid formats: the model's whole list."""
    return model_fp32_modules()


def k3_fp32() -> tuple[str, ...]:
    """The entries kept for Kimi K3 folders: the model's list but what the release stores in the model's dtype."""
    return tuple(m for m in model_fp32_modules() if m not in _K3_MODEL_DTYPE)


def keeps_fp32(name: str, entries: tuple[str, ...]) -> bool:
    """Whether tensor `name` is one of entries: an entry ("A_log", "gate.weight") matches a run of whole dotted
    components of the name, in any naming ("model.layers.1.mlp.gate.weight", "...block_sparse_moe.gate.weight")."""
    parts = name.split(".")
    for entry in entries:
        want = entry.split(".")
        if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
            return True
    return False


def describe(entries: tuple[str, ...]) -> str:
    """The entries for a help text: "A_log, dt_bias, ... and o_norm"."""
    return ", ".join(entries[:-1]) + f" and {entries[-1]}" if len(entries) > 1 else "".join(entries)


__all__ = ["describe", "k3_fp32", "keeps_fp32", "kimi_linear_fp32", "model_fp32_modules"]
