"""Hub export: what makes a saved folder load with stock transformers and trust_remote_code=True.

`save_pretrained` / `push_to_hub` of the models (through `RemoteCodeMixin`) and of the processors (through
`RemoteCodeProcessorMixin`) write the auto_map, copy the saved model type's code (`export_code`: the import
closure of its auto_map modules, flattened into one folder) next to the weights and write a model card
(README.md) unless one exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile

from ..atomic_io import atomic_write, set_normal_mode


HERE = os.path.dirname(os.path.abspath(__file__))

# The one Auto-class table: kimi_hf's import registers every entry with transformers (kimi_hf/__init__.py),
# saved model configs carry their model type's entries as auto_map (RemoteCodeMixin), and saved processors
# carry theirs (register_for_auto_class at registration), so remote-code loads find the same classes.
AUTO_MAPS = {
    "kimi_hybrid_text": {
        "AutoConfig": "configuration_kimi_hybrid.KimiHybridTextConfig",
        "AutoModel": "modeling_kimi_hybrid.KimiHybridTextModel",
        "AutoModelForCausalLM": "modeling_kimi_hybrid.KimiHybridForCausalLM",
    },
    "kimi_hybrid_vision": {
        "AutoConfig": "configuration_kimi_hybrid.KimiHybridVisionConfig",
        "AutoModel": "modeling_kimi_hybrid_vision.KimiHybridVisionModel",
    },
    "kimi_hybrid": {
        "AutoConfig": "configuration_kimi_hybrid.KimiHybridConfig",
        "AutoModel": "modeling_kimi_hybrid_multimodal.KimiHybridModel",
        "AutoModelForCausalLM": "modeling_kimi_hybrid_multimodal.KimiHybridForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_kimi_hybrid_multimodal.KimiHybridForConditionalGeneration",
        "AutoImageProcessor": "image_processing_kimi_hybrid.KimiHybridImageProcessor",
        "AutoProcessor": "processing_kimi_hybrid.KimiHybridProcessor",
    },
    # Kimi K3 as released (model_type "kimi_k3"); its sub-configs' classes for AutoConfig of saved sub-folders
    "kimi_k3_text": {
        "AutoConfig": "configuration_kimi_k3.KimiK3TextConfig",
        "AutoModel": "modeling_kimi_k3.KimiK3TextModel",
        "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM",
    },
    "kimi_k3_vision": {
        "AutoConfig": "configuration_kimi_k3_vision.KimiK3VisionConfig",
        "AutoModel": "modeling_kimi_k3_vision.KimiK3VisionModel",
    },
    "kimi_k3": {
        "AutoConfig": "configuration_kimi_k3.KimiK3Config",
        "AutoModel": "modeling_kimi_k3.KimiK3Model",
        "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        "AutoImageProcessor": "image_processing_kimi_k3.KimiK3ImageProcessor",
        "AutoProcessor": "processing_kimi_k3.KimiK3Processor",
    },
}
# processor classes: saved beside the config in their own files, not in config.json's auto_map
PROCESSOR_AUTO_CLASSES = ("AutoImageProcessor", "AutoProcessor")


def module_file(module: str) -> str:
    """The source file of an auto_map module ("modeling_kimi_k3"): in the package, `models/<model folder>/`; in a
    saved (flat) folder, beside this file. Module names are unique across the model folders and ops."""
    for folder in (HERE, *sorted(os.path.join(HERE, d) for d in os.listdir(HERE))):
        path = os.path.join(folder, module + ".py")
        if os.path.isfile(path):
            return path
    raise ValueError(f"no module {module!r} in {HERE} or its model folders")


# A relative import as transformers' get_relative_imports sees it (`^\s*from\s+\.(\S+)\s+import`, indented lazy
# imports included), with any number of dots: (from )(dots)(dotted name)( import)
_RELATIVE_IMPORT = re.compile(r"^(\s*from\s+)(\.+)([\w.]*)(\s+import\b)", re.MULTILINE)
_RELATIVE_MODULE_IMPORT = re.compile(r"^\s*import\s+\.", re.MULTILINE)


def _imported_files(path: str) -> list[str]:
    """The files that `path` imports relatively (`from ..ops.kda import x` -> <package>/ops/kda.py)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if _RELATIVE_MODULE_IMPORT.search(text):
        raise ValueError(f"{path}: `import .x` cannot be copied into a Hub folder; write `from .x import ...`")
    found = []
    for match in _RELATIVE_IMPORT.finditer(text):
        dots, dotted = match.group(2), match.group(3)
        base = os.path.dirname(path)
        for _ in range(len(dots) - 1):
            base = os.path.dirname(base)
        target = os.path.join(base, *dotted.split(".")) + ".py" if dotted else ""
        if not os.path.isfile(target):  # `from . import x` or a package's __init__: no flat sibling file to name
            raise ValueError(
                f"{path}: `from {dots}{dotted} import` does not name a module file; Hub folders are flat, so import "
                "from the module itself (e.g. `from ...ops.kda import chunk_kda`)"
            )
        found.append(target)
    return found


def import_closure(modules) -> dict[str, str]:
    """{file name: source path} of the auto_map modules ("modeling_kimi_k3", ...) and every file they import
    relatively, recursively (lazy imports included): the code a remote-code load of them runs."""
    return import_closure_of_files([module_file(m) for m in modules])


def import_closure_of_files(paths) -> dict[str, str]:
    """`import_closure` of source files. Raises a ValueError if two of the files share a name (they would
    overwrite each other in the flat folder) or an import cannot be flattened."""
    todo = [os.fspath(p) for p in paths]
    closure: dict[str, str] = {}
    while todo:
        path = os.path.realpath(todo.pop())
        name = os.path.basename(path)
        if name in closure:
            if closure[name] != path:
                raise ValueError(f"{closure[name]} and {path} would both be {name} in a saved folder")
            continue
        closure[name] = path
        todo.extend(_imported_files(path))
    return closure


def flatten_imports(source: str) -> str:
    """`from ..kimi_hybrid.x import` / `from ...ops.kda import` -> `from .x import` / `from .kda import`: the
    imports of a flat folder, the only ones transformers' remote-code loader follows."""
    return _RELATIVE_IMPORT.sub(lambda m: f"{m.group(1)}.{m.group(3).rsplit('.', 1)[-1]}{m.group(4)}", source)


def model_modules(model_type: str, processors: bool = False) -> list[str]:
    """The auto_map modules of a model type: its config's and models' (or, processors=True, its processors')."""
    entries = AUTO_MAPS[model_type]
    return sorted(
        {ref.partition(".")[0] for auto, ref in entries.items() if (auto in PROCESSOR_AUTO_CLASSES) == processors}
    )


# Code files that earlier versions of kimi_hf wrote into saved folders and no model's closure has any more (their
# code moved into other files): a save into such a folder removes them, so that it holds the current code only
FORMER_CODE_FILES = ("hub_kimi_hybrid.py", "mxfp4_kimi_hybrid.py", "mxfp4_kimi_k3.py")


def export_code(save_directory: str, modules) -> list[str]:
    """Writes the import closure of `modules`, flattened, into save_directory (each file atomically, with normal
    permissions) and removes FORMER_CODE_FILES there. Returns the file names written."""
    closure = import_closure(modules)
    for name, path in sorted(closure.items()):
        with open(path, encoding="utf-8") as f:
            atomic_write(os.path.join(save_directory, name), flatten_imports(f.read()))
    for name in FORMER_CODE_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(save_directory, name))
    return sorted(closure)


def weight_files(save_directory: str) -> list[str]:
    """The safetensors weights of a saved folder: model.safetensors or the shards its index lists."""
    names = {"model.safetensors"}
    index = os.path.join(save_directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names |= set(json.load(f)["weight_map"].values())
    return sorted(p for p in (os.path.join(save_directory, n) for n in names) if os.path.isfile(p))


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def model_card(model) -> str:
    """README.md for a saved model: architecture, layer layout, parameter counts, how to load."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    k3 = config.model_type == "kimi_k3"
    multimodal = config.model_type == "kimi_hybrid" or k3
    total = _count(model)
    vision = _count(getattr(getattr(model, "model", model), "vision_tower", None)) if multimodal else 0
    lines = ["---", "library_name: transformers", "tags:", "- kimi_hf", "- kimi-delta-attention", "- hybrid-attention"]
    lines += (
        ["- early-fusion", "pipeline_tag: image-text-to-text"] if multimodal else ["pipeline_tag: text-generation"]
    )
    lines += ["---", "", f"# {type(model).__name__}", ""]
    if hasattr(text, "layer_types"):
        n_kda = sum(t == "linear_attention" for t in text.layer_types)
        width = text.routed_expert_hidden_size or text.hidden_size  # Stable LatentMoE's experts run in the latent
        experts = text.num_experts * 3 * width * text.moe_intermediate_size  # routed experts of one layer
        idle = experts * (text.num_experts - text.num_experts_per_tok) // text.num_experts  # not used by a token
        n_moe = sum(t == "sparse" for t in text.mlp_layer_types)
        what = (
            "Kimi K3's architecture in its released layout (safe-gate KDA, gated MLA with q LoRA, SiTU, Stable "
            "LatentMoE, Block Attention Residuals, a MoonViT3d tower), saved with kimi_hf: Kimi Delta Attention"
            if k3
            else "A hybrid decoder in Kimi Linear's layout, built with kimi_hf: Kimi Delta Attention"
        )
        lines += [
            what + " (linear attention with per-channel forgetting) mixed with MLA full attention, and "
            "DeepSeek-V3-style MoE feed-forward layers."
            + (
                " Early fusion: a MoonViT vision tower's merged patches are written into the image "
                "placeholder positions of the token stream."
                if multimodal
                else ""
            ),
            "",
            f"- parameters: {total:,} total; about {total - idle * n_moe:,} active per token",
            f"- text: {text.num_hidden_layers} layers ({n_kda} KDA, {text.num_hidden_layers - n_kda} MLA), hidden "
            f"{text.hidden_size}, vocabulary {text.vocab_size}, {text.num_experts} experts ({text.num_experts_per_tok} "
            "per token)",
        ]
        if multimodal:
            vc = config.vision_config
            lines.append(
                f"- vision: {vision:,} parameters, {vc.num_hidden_layers} layers, hidden {vc.hidden_size}, "
                f"patch {vc.patch_size}, {vc.merge_kernel_size[0]}x{vc.merge_kernel_size[1]} merge; image "
                f"placeholder id {config.image_token_id}"
            )
        lines += ["", "| layer | mixer | feed-forward |", "|---|---|---|"]
        lines += [
            f"| {i} | {'KDA' if t == 'linear_attention' else 'MLA'} | {'MoE' if m == 'sparse' else 'dense'} |"
            for i, (t, m) in enumerate(zip(text.layer_types, text.mlp_layer_types))
        ]
    auto = "AutoModelForImageTextToText" if multimodal else "AutoModelForCausalLM"
    lines += [
        "",
        "## Loading",
        "",
        "With kimi_hf installed (Triton kernels on CUDA):",
        "",
        "```python",
        "import kimi_hf",
        f"from transformers import {auto}",
        f'model = {auto}.from_pretrained("<repo>")',
        "```",
        "",
        "With stock transformers only (this repository's code; the PyTorch KDA path, CPU or GPU):",
        "",
        "```python",
        f"from transformers import {auto}",
        f'model = {auto}.from_pretrained("<repo>", trust_remote_code=True)',
        "```",
        "",
    ]
    return "\n".join(lines)


def upload(
    folder: str,
    repo_id: str,
    token=None,
    private=None,
    commit_message: str | None = None,
    create_pr: bool = False,
    revision: str | None = None,
):
    """Creates the Hub repo if needed and uploads `folder` as one commit."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        commit_message=commit_message or "Upload model",
        create_pr=create_pr,
        revision=revision,
    )


def conversion_error_messages(conversion_errors: dict) -> list[str]:
    """transformers' loader keeps each failed checkpoint conversion as `{target: traceback}`; the messages of the
    exceptions our conversion ops raise (each naming the tensor) are the lines after the traceback."""
    messages = []
    for target, text in conversion_errors.items():
        lines = [line for line in str(text).splitlines() if line.strip()]
        found = [m.group(1) for line in lines if (m := re.match(r"^[\w.]+(?:Error|Exception): (.*)", line))]
        message = found[-1] if found else (lines[-1] if lines else str(text))
        messages.append(message if target in message else f"{target}: {message}")
    return messages


class RemoteCodeMixin:
    """save_pretrained and push_to_hub also write the auto_map, the code and our model card
    (transformers' own push would replace the card with an empty template: we upload ourselves)."""

    @staticmethod
    def _finalize_model_loading(model, load_config, loading_info):
        """transformers raises a generic RuntimeError ("see the CONVERSION entries of the report") when a checkpoint
        conversion fails; a bad tensor of a Kimi checkpoint gets a ValueError naming it instead."""
        from transformers.modeling_utils import PreTrainedModel  # here: the atomic-write helpers stay import-light

        try:
            return PreTrainedModel._finalize_model_loading(model, load_config, loading_info)
        except RuntimeError:
            if not getattr(loading_info, "conversion_errors", None):
                raise
            raise ValueError("; ".join(conversion_error_messages(loading_info.conversion_errors))) from None

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        hub = {
            k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private", "revision") if k in kwargs
        }
        # the class's model_type: a config read from Moonshot's folder keeps model_type "kimi_linear" (and its auto_map)
        auto_map = AUTO_MAPS.get(type(self.config).model_type)
        if auto_map is not None:
            self.config.auto_map = {k: v for k, v in auto_map.items() if k not in PROCESSOR_AUTO_CLASSES}
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True) or not os.path.isdir(save_directory):
            return
        for path in weight_files(str(save_directory)):  # safetensors writes them 0o600
            set_normal_mode(path)
        if auto_map is not None:
            export_code(str(save_directory), model_modules(type(self.config).model_type))
        card = os.path.join(save_directory, "README.md")
        if not os.path.exists(card):
            atomic_write(card, model_card(self))
        if push_to_hub:
            upload(
                str(save_directory),
                hub.pop("repo_id", os.path.basename(os.path.abspath(save_directory))),
                token=kwargs.get("token"),
                **hub,
            )

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        private: bool | None = None,
        token=None,
        max_shard_size: int | str = "50GB",
        create_pr: bool = False,
        revision: str | None = None,
        **kwargs,
    ):
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, max_shard_size=max_shard_size)
            return upload(
                folder,
                repo_id,
                token=token,
                private=private,
                commit_message=commit_message,
                create_pr=create_pr,
                revision=revision,
            )


@contextlib.contextmanager
def _flat_sources(objects):
    """While saving: the modules of `objects` (processors registered for an Auto class) point transformers at
    flattened copies of their import closure. transformers' `custom_object_save` copies an object's module file
    and the files it imports with single-dot imports from the same folder, which a per-model source tree does
    not have; from the flattened copies it copies exactly the closure, and writes the auto_map as it always does."""
    modules = {sys.modules[type(o).__module__] for o in objects if getattr(o, "_auto_class", None) is not None}
    with tempfile.TemporaryDirectory(prefix="kimi_hf_code_") as flat:
        saved = {}
        try:
            for module in modules:
                export_code(flat, [module.__name__.rpartition(".")[2]])
                saved[module] = module.__file__
                module.__file__ = os.path.join(flat, os.path.basename(module.__file__))
            yield
        finally:
            for module, path in saved.items():
                module.__file__ = path


class RemoteCodeProcessorMixin:
    """save_pretrained of a processor (or an image processor) registered for an Auto class copies the import
    closure of its module, flattened, as models' saves do (see `_flat_sources`)."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        attributes = [getattr(self, a) for a in self.get_attributes()] if hasattr(self, "get_attributes") else []
        with _flat_sources([self, *attributes]):
            return super().save_pretrained(save_directory, *args, **kwargs)


__all__ = [
    "RemoteCodeMixin",
    "AUTO_MAPS",
    "PROCESSOR_AUTO_CLASSES",
    "atomic_write",
    "FORMER_CODE_FILES",
    "RemoteCodeProcessorMixin",
    "export_code",
    "flatten_imports",
    "import_closure",
    "import_closure_of_files",
    "model_modules",
    "module_file",
    "model_card",
    "upload",
    "weight_files",
]
