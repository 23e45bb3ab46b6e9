"""Hub export: what makes a saved folder load with stock transformers and trust_remote_code=True.

`save_pretrained` / `push_to_hub` of the models in this folder (through `RemoteCodeMixin`) write
the config's auto_map, copy this folder's code files next to the weights (they import only torch,
transformers and each other) and write a model card (README.md) unless one exists.

It also holds the package's atomic-write helpers (`atomic_write`, `make_temp_dir`): files and
directories are written through temporary ones and renamed, yet get the permissions open() / mkdir()
would give them (0o666 / 0o777 & ~umask), not mkstemp's / mkdtemp's private 0o600 / 0o700.
kimi_hf.plotting and kimi_hf.conversion use them too (this folder cannot import from outside it).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading


HERE = os.path.dirname(os.path.abspath(__file__))
_UMASK_LOCK = threading.Lock()

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
        "AutoConfig": "configuration_kimi_hybrid_vision.KimiK3VisionConfig",
    },
    "kimi_k3": {
        "AutoConfig": "configuration_kimi_k3.KimiK3Config",
        "AutoModel": "modeling_kimi_k3.KimiK3Model",
        "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        "AutoModelForImageTextToText": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        "AutoImageProcessor": "image_processing_kimi_hybrid.KimiK3ImageProcessor",
        "AutoProcessor": "processing_kimi_k3.KimiK3Processor",
    },
}
# processor classes: saved beside the config in their own files, not in config.json's auto_map
PROCESSOR_AUTO_CLASSES = ("AutoImageProcessor", "AutoProcessor")


def code_files() -> list[str]:
    """The folder's modules (everything a remote-code load imports)."""
    return sorted(os.path.join(HERE, f) for f in os.listdir(HERE) if f.endswith(".py") and f != "__init__.py")


# --------------------------------------------------------------------------------------------
# Atomic writes with normal permissions (the one place for them: plotting and conversion use these too)
# --------------------------------------------------------------------------------------------
def current_umask() -> int:
    """The process umask. Linux reports it in /proc/self/status; elsewhere it can only be read by
    setting it, so it is set and restored under a lock (other threads may still race with that)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def normal_mode(directory: bool = False) -> int:
    """The mode open() / mkdir() would give a new file (0o666) or directory (0o777) under the umask:
    mkstemp / mkdtemp create theirs private (0o600 / 0o700)."""
    return (0o777 if directory else 0o666) & ~current_umask()


def atomic_write(path: str, data: bytes | str) -> str:
    """Writes data (str as UTF-8) to path through a temporary file in the same directory and a
    rename, so that readers never see a partial file; the file gets `normal_mode()`. Returns path."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            os.fchmod(f.fileno(), normal_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def set_normal_mode(path: str) -> None:
    """Gives a file written by another library through a temporary file (safetensors >= 0.8 writes
    0o600 weights) the mode open() would have given it."""
    os.chmod(path, normal_mode(directory=os.path.isdir(path)))


def weight_files(save_directory: str) -> list[str]:
    """The safetensors weights of a saved folder: model.safetensors or the shards its index lists."""
    names = {"model.safetensors"}
    index = os.path.join(save_directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names |= set(json.load(f)["weight_map"].values())
    return sorted(p for p in (os.path.join(save_directory, n) for n in names) if os.path.isfile(p))


def make_temp_dir(parent: str, prefix: str) -> str:
    """A new temporary directory in parent (to be renamed into place later) with `normal_mode(True)`."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(tmp, normal_mode(directory=True))
    return tmp


def copy_code(save_directory: str) -> None:
    """Copies the code files into save_directory (each atomically, with normal permissions)."""
    for path in code_files():
        with open(path, "rb") as f:
            atomic_write(os.path.join(save_directory, os.path.basename(path)), f.read())


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
        copy_code(str(save_directory))
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


__all__ = [
    "RemoteCodeMixin",
    "AUTO_MAPS",
    "PROCESSOR_AUTO_CLASSES",
    "atomic_write",
    "copy_code",
    "make_temp_dir",
    "model_card",
    "normal_mode",
    "set_normal_mode",
    "upload",
    "weight_files",
]
