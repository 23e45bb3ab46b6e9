"""The Kimi Linear model family (KDA/MLA hybrid decoder) and its early-fusion MoonViT tower.

Saved folders get this folder's modules (and those of `kimi_hf.ops` and `kimi_hf.models.kimi_k3` they use)
flattened into one folder by `kimi_hf.models.hub_kimi.export_code`, so the modules import only torch,
transformers, the standard library and each other, relatively.

Modules that lived here before Kimi K3 got its own folder stay importable under their old names
(`kimi_hf.models.kimi_hybrid.kda` is `kimi_hf.ops.kda`, `...kimi_hybrid.modeling_kimi_k3` is
`kimi_hf.models.kimi_k3.modeling_kimi_k3`, `kimi_hf.models.kimi_k3.mxfp4_kimi_k3` is `kimi_hf.ops.mxfp4`, ...):
the same module objects, with a DeprecationWarning.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


_MOVED = {
    **{m: f"kimi_hf.ops.{m}" for m in ("kda", "kda_chunk", "kda_inputs", "kda_recurrent", "depth_attention")},
    **{
        m: f"kimi_hf.models.kimi_k3.{m}"
        for m in ("configuration_kimi_k3", "modeling_kimi_k3", "processing_kimi_k3", "chat_template_kimi_k3")
    },
    "mxfp4_kimi_hybrid": "kimi_hf.ops.mxfp4",
    "hub_kimi_hybrid": "kimi_hf.models.hub_kimi",
}
_MOVED = {f"{__name__}.{old}": new for old, new in _MOVED.items()}
_MOVED["kimi_hf.models.kimi_k3.mxfp4_kimi_k3"] = "kimi_hf.ops.mxfp4"  # the codec is an op (the experts' matmul)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `kimi_hf.models.kimi_hybrid.<old name>` and loads it as the module's new home."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = _MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the new module ran when it was imported


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
