"""Hub export: what makes a saved folder load with stock transformers and trust_remote_code=True.

`save_pretrained` / `push_to_hub` of the models in this folder (through `RemoteCodeMixin`) write
the config's auto_map, copy this folder's code files next to the weights (they import only torch,
transformers and each other) and write a model card (README.md) unless one exists.
"""

from __future__ import annotations

import os
import shutil
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

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
    },
}


def code_files() -> list[str]:
    """The folder's modules (everything a remote-code load imports)."""
    return sorted(os.path.join(HERE, f) for f in os.listdir(HERE) if f.endswith(".py") and f != "__init__.py")


def copy_code(save_directory: str) -> None:
    """Copies the code files into save_directory (each through a temporary file and a rename)."""
    for path in code_files():
        fd, tmp = tempfile.mkstemp(dir=save_directory, suffix=".tmp")
        os.close(fd)
        shutil.copyfile(path, tmp)
        os.replace(tmp, os.path.join(save_directory, os.path.basename(path)))


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def model_card(model) -> str:
    """README.md for a saved model: architecture, layer layout, parameter counts, how to load."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    multimodal = config.model_type == "kimi_hybrid"
    total = _count(model)
    vision = _count(getattr(getattr(model, "model", model), "vision_tower", None)) if multimodal else 0
    lines = ["---", "library_name: transformers", "tags:", "- kimi_hf", "- kimi-delta-attention", "- hybrid-attention"]
    lines += ["- early-fusion", "pipeline_tag: image-text-to-text"] if multimodal else ["pipeline_tag: text-generation"]
    lines += ["---", "", f"# {type(model).__name__}", ""]
    if hasattr(text, "layer_types"):
        n_kda = sum(t == "linear_attention" for t in text.layer_types)
        experts = text.num_experts * 3 * text.hidden_size * text.moe_intermediate_size  # routed experts of one layer
        idle = experts * (text.num_experts - text.num_experts_per_tok) // text.num_experts  # not used by a token
        n_moe = sum(t == "sparse" for t in text.mlp_layer_types)
        lines += [
            "A hybrid decoder in Kimi Linear's layout, built with kimi_hf: Kimi Delta "
            "Attention (linear attention with per-channel forgetting) mixed with MLA full attention, and "
            "DeepSeek-V3-style MoE feed-forward layers." + (
                " Early fusion: a MoonViT vision tower's merged patches are written into the image "
                "placeholder positions of the token stream." if multimodal else ""),
            "",
            f"- parameters: {total:,} total; about {total - idle * n_moe:,} active per token",
            f"- text: {text.num_hidden_layers} layers ({n_kda} KDA, {text.num_hidden_layers - n_kda} MLA), hidden "
            f"{text.hidden_size}, vocabulary {text.vocab_size}, {text.num_experts} experts ({text.num_experts_per_tok} "
            "per token)",
        ]
        if multimodal:
            vc = config.vision_config
            lines.append(f"- vision: {vision:,} parameters, {vc.num_hidden_layers} layers, hidden {vc.hidden_size}, "
                         f"patch {vc.patch_size}, {vc.merge_kernel_size[0]}x{vc.merge_kernel_size[1]} merge; image "
                         f"placeholder id {config.image_token_id}")
        lines += ["", "| layer | mixer | feed-forward |", "|---|---|---|"]
        lines += [f"| {i} | {'KDA' if t == 'linear_attention' else 'MLA'} | {'MoE' if m == 'sparse' else 'dense'} |"
                  for i, (t, m) in enumerate(zip(text.layer_types, text.mlp_layer_types))]
    auto = "AutoModelForImageTextToText" if multimodal else "AutoModelForCausalLM"
    lines += [
        "", "## Loading", "", "With kimi_hf installed (Triton kernels on CUDA):", "", "```python", "import kimi_hf",
        f"from transformers import {auto}", f'model = {auto}.from_pretrained("<repo>")', "```", "",
        "With stock transformers only (this repository's code; the PyTorch KDA path, CPU or GPU):", "", "```python",
        f"from transformers import {auto}", f'model = {auto}.from_pretrained("<repo>", trust_remote_code=True)', "```", "",
    ]
    return "\n".join(lines)


def upload(folder: str, repo_id: str, token=None, private=None, commit_message: str | None = None,
           create_pr: bool = False, revision: str | None = None):
    """Creates the Hub repo if needed and uploads `folder` as one commit."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message or "Upload model",
                             create_pr=create_pr, revision=revision)


class RemoteCodeMixin:
    """save_pretrained and push_to_hub also write the auto_map, the code and our model card
    (transformers' own push would replace the card with an empty template: we upload ourselves)."""

    def save_pretrained(self, save_directory, *args, push_to_hub: bool = False, **kwargs):
        hub = {k: kwargs.pop(k) for k in ("repo_id", "commit_message", "create_pr", "private", "revision") if k in kwargs}
        auto_map = AUTO_MAPS.get(self.config.model_type)
        if auto_map is not None:
            self.config.auto_map = dict(auto_map)
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True) or not os.path.isdir(save_directory):
            return
        copy_code(str(save_directory))
        card = os.path.join(save_directory, "README.md")
        if not os.path.exists(card):
            with open(card + ".tmp", "w", encoding="utf-8") as f:
                f.write(model_card(self))
            os.replace(card + ".tmp", card)
        if push_to_hub:
            upload(str(save_directory), hub.pop("repo_id", os.path.basename(os.path.abspath(save_directory))),
                   token=kwargs.get("token"), **hub)

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                    token=None, max_shard_size: int | str = "50GB", create_pr: bool = False, revision: str | None = None,
                    **kwargs):
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, max_shard_size=max_shard_size)
            return upload(folder, repo_id, token=token, private=private, commit_message=commit_message,
                          create_pr=create_pr, revision=revision)


__all__ = ["RemoteCodeMixin", "AUTO_MAPS", "copy_code", "model_card", "upload"]
