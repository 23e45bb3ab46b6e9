"""Kimi K2.5's vision tower and projector + a hybrid text checkpoint -> one early-fusion checkpoint.

K2.5 checkpoints (Moonshot's release, and what transformers' kimi_k25 save_pretrained writes) name
the tower `vision_tower.encoder.blocks.{i}.{wqkv, wo, norm0, norm1, mlp.fc0, mlp.fc1}` with q/k rows
in RoPE's interleaved (complex) order; transformers' in-memory naming (`model.vision_tower.layers...`,
rotate-half order) is accepted too. The language-model tensors of the K2.5 checkpoint are skipped
without being read. K2.5's projector maps into DeepSeek-V3's hidden size (7168): when the text model's
hidden size differs, its last layer (out_proj) cannot be reused and is left out (the loaded model
initialises it; train it before use) -- the summary says so.
"""

from __future__ import annotations

import os
import re

import torch

from ..models.kimi_hybrid.chat_markup_kimi_hybrid import IMAGE_TOKEN
from ..models.kimi_hybrid.conversion_mapping_kimi_hybrid import moonvit_key_mapping
from .checkpoint import CheckpointReader, ShardedWriter, read_config
from .kimi_linear import (
    NATIVE,
    OURS,
    cast,
    check_complete,
    check_source,
    convert_config,
    copy_side_files,
    expected_shapes,
    native_to_ours,
)
from .monitor import peak_rss_mb, progress


# Moonshot's MoonViT names (K2.5's tower is K3's) -> ours, relative to the tower's root: the one table, whose
# fused `wqkv` -> `attn.qkv_proj` is K3's layout (rope_type "interleaved_2d"); this tower is built "axial" (K2.5 in
# transformers' names), so a renamed qkv_proj is split into q/k/v_proj, q/k rows in rotate-half order (_QKV)
_TOWER_RENAMES = [(re.compile(pattern), target) for pattern, target in moonvit_key_mapping()]
_QKV = re.compile(r"^(layers\.\d+\.attn\.)qkv_proj\.(weight|bias)$")
_VISION_FIELDS = (
    "patch_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "merge_kernel_size",
    "pos_emb_height",
    "pos_emb_width",
    "pos_emb_time",
    "rope_parameters",
)


def interleaved_to_half(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """q/k rows (or biases) from RoPE's interleaved pairs to rotate-half order, per head (what
    transformers' PermuteForRope does when it loads K2.5)."""
    dim = w.shape[0]
    half = dim // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def vision_tensors(name: str, t: torch.Tensor, num_heads: int, file: str | None = None):
    """One K2.5 tensor -> (our name inside KimiHybridModel, tensor) pairs; [] for language-model tensors.
    Errors name the tensor as the checkpoint spells it (and its file, when given)."""
    where = f"{name} (in {file})" if file else name
    try:
        out = _vision_tensors(name, t, num_heads)
    except RuntimeError as err:  # e.g. a fused wqkv whose rows do not split into heads
        raise ValueError(
            f"tensor {where} has shape {tuple(t.shape)}, which does not fit {num_heads} attention heads: {err}"
        ) from None
    if out is None:
        raise ValueError(f"unknown tensor {where} in the K2.5 checkpoint: not part of its vision tower or projector")
    return out


def _tower_name(rest: str) -> str:
    """A tensor name relative to the tower's root in our naming: Moonshot's renamed by the MoonViT table (the first
    pair that matches; no target matches another source), ours (transformers' in-memory naming) unchanged."""
    # transformers' kimi_k25 loader takes `vision_tower.encoder.` as a whole for the tower's root, patch_embed too
    if rest.startswith("encoder.patch_embed."):
        rest = rest.removeprefix("encoder.")
    for pattern, target in _TOWER_RENAMES:
        if pattern.match(rest):
            return pattern.sub(target, rest, count=1)
    return rest


def _vision_tensors(name: str, t: torch.Tensor, num_heads: int):
    n = name.removeprefix("model.")
    if n.startswith(("language_model.", "lm_head.")):
        return []
    if n.startswith("vision_tower."):
        rest = _tower_name(n.removeprefix("vision_tower."))
        if (m := _QKV.match(rest)) is None:
            return [(f"model.vision_tower.{rest}", t)]
        prefix, kind = f"model.vision_tower.{m.group(1)}", m.group(2)
        q, k, v = t.chunk(3, dim=0)
        return [
            (f"{prefix}q_proj.{kind}", interleaved_to_half(q, num_heads).contiguous()),
            (f"{prefix}k_proj.{kind}", interleaved_to_half(k, num_heads).contiguous()),
            (f"{prefix}v_proj.{kind}", v.contiguous()),
        ]
    for old, new in (
        ("mm_projector.proj.0.", "in_proj."),
        ("mm_projector.proj.2.", "out_proj."),
        ("mm_projector.in_proj.", "in_proj."),
        ("mm_projector.out_proj.", "out_proj."),
        ("mm_projector.pre_norm.", "pre_norm."),
    ):
        if n.startswith(old):
            return [(f"model.mm_projector.{new}{n[len(old) :]}", t)]
    return None  # not a tensor of the vision tower or projector


def assemble(
    text_src: str,
    vision_src: str,
    dst: str,
    image_token_id: int | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    show_progress: bool = True,
) -> dict:
    """Writes dst (must not exist): a KimiHybridForConditionalGeneration checkpoint made of text_src's
    decoder (ours or the native Kimi Linear naming) and vision_src's K2.5 tower + projector."""
    from kimi_hf import KimiHybridConfig, KimiHybridForConditionalGeneration, KimiHybridVisionConfig

    text_cfg, k25_cfg = read_config(text_src), read_config(vision_src)
    if k25_cfg.get("model_type") != "kimi_k25" or "vision_config" not in k25_cfg:
        raise ValueError(
            f"{vision_src}/config.json has model_type {k25_cfg.get('model_type')!r}; expected a Kimi K2.5 "
            "checkpoint ('kimi_k25' with a vision_config)"
        )
    if text_cfg.get("model_type") not in (OURS, NATIVE):
        raise ValueError(
            f"{text_src}/config.json has model_type {text_cfg.get('model_type')!r}; expected {OURS!r} or {NATIVE!r}"
        )
    ours_text = convert_config(text_cfg) if text_cfg["model_type"] == NATIVE else text_cfg
    ours_text = {k: v for k, v in ours_text.items() if k not in ("architectures", "auto_map", "transformers_version")}
    vision_cfg = KimiHybridVisionConfig(**{k: v for k, v in k25_cfg["vision_config"].items() if k in _VISION_FIELDS})
    if image_token_id is None:
        image_token_id = _image_token_id(text_src, k25_cfg, ours_text["vocab_size"])
    config = KimiHybridConfig(
        text_config=ours_text,
        vision_config=vision_cfg,
        image_token_id=image_token_id,
        projection_layer_norm_eps=k25_cfg.get("projection_layer_norm_eps", 1e-5),
    )
    hidden, heads = config.text_config.hidden_size, vision_cfg.num_attention_heads
    notes = []
    text_reader, vision_reader = CheckpointReader(text_src), CheckpointReader(vision_src)
    with torch.device("meta"):  # our tensor names and shapes, without memory
        state = KimiHybridForConditionalGeneration(config).state_dict()
    vision_expected = {
        k: tuple(v.shape) for k, v in state.items() if k.startswith(("model.vision_tower.", "model.mm_projector."))
    }
    with ShardedWriter(dst, max_shard_size) as writer:
        wanted = [
            n
            for n in vision_reader.names()
            if not n.removeprefix("model.").startswith(("language_model.", "lm_head."))
        ]
        for name in progress(wanted, len(wanted), "vision", show_progress):
            file, source = os.path.join(vision_src, vision_reader.file_of(name)), vision_reader.get(name)
            for new, t in vision_tensors(name, source, heads, file):
                if new.startswith("model.mm_projector.out_proj.") and t.shape[0] != hidden:
                    note = (
                        f"K2.5's projector maps to {t.shape[0]} but the text hidden size is {hidden}: "
                        "mm_projector.out_proj is left out (initialised at load; train it)"
                    )
                    if note not in notes:
                        notes.append(note)
                    continue
                if new not in vision_expected:
                    raise ValueError(
                        f"unknown tensor {name} (in {file}): not part of the vision tower or projector of the config"
                    )
                if tuple(t.shape) != vision_expected[new]:
                    raise ValueError(
                        f"tensor {name} (in {file}) has shape {tuple(source.shape)}, "
                        f"which does not fit the config (its {new} would be {tuple(t.shape)}, the config "
                        f"implies {vision_expected[new]})"
                    )
                writer.add(new, cast(new, t, dtype))
        names = text_reader.names()
        native, text_expected = text_cfg["model_type"] == NATIVE, expected_shapes(ours_text)
        tensors = check_source(((n, text_reader.get(n)) for n in names), text_expected, text_reader, native=native)
        if native:
            tensors = native_to_ours(tensors, config.text_config.linear_num_heads, config.text_config.num_experts)
        text_written = set()
        for name, t in progress(tensors, len(names), "text", show_progress):
            text_written.add(name)
            writer.add(
                name if name.startswith("lm_head.") else "model.language_model." + name.removeprefix("model."),
                cast(name, t, dtype),
            )
        check_complete(text_written, text_expected, text_reader, native=native)
        out_cfg = config.to_dict()
        out_cfg["architectures"] = ["KimiHybridForConditionalGeneration"]
        writer.write_json("config.json", out_cfg)
        copy_side_files(text_src, writer, out_cfg["text_config"])
        shards = writer.finish()
    for note in notes:
        print(f"note: {note}")
    return {
        "shards": len(shards),
        "tensors": len(writer.seen),
        "peak_rss_mb": peak_rss_mb(),
        "notes": notes,
        "image_token_id": image_token_id,
    }


def _image_token_id(text_src: str, k25_cfg: dict, vocab: int) -> int:
    """<|media_pad|> of the text checkpoint's tokenizer, else K2.5's id when it fits the vocabulary."""
    if os.path.exists(os.path.join(text_src, "tokenizer.json")) or os.path.exists(
        os.path.join(text_src, "tiktoken.model")
    ):
        from .tokenizer import load_fast_tokenizer, tiktoken_to_fast

        if os.path.exists(os.path.join(text_src, "tokenizer.json")):
            tok = load_fast_tokenizer(text_src)  # no remote code, no prompt
        else:
            tok = tiktoken_to_fast(
                os.path.join(text_src, "tiktoken.model"), os.path.join(text_src, "tokenizer_config.json")
            )
        tid = tok.convert_tokens_to_ids(IMAGE_TOKEN)
        if tid is not None and tid != tok.unk_token_id:
            return tid
    tid = k25_cfg.get("image_token_id")
    if tid is not None and tid < vocab:
        return tid
    raise ValueError(
        "no image placeholder id: the text checkpoint's tokenizer has no <|media_pad|> and K2.5's "
        f"image_token_id {tid} is outside the text vocabulary ({vocab}); pass --image-token-id"
    )


__all__ = ["assemble", "vision_tensors", "interleaved_to_half"]
