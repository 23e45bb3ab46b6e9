"""Trainer's checkpoints of Kimi K3 (issue 24 item 1): `save_model()` and the step checkpoints of Trainer's default
save strategy write K3's released layout, and `resume_from_checkpoint` continues bit for bit (the uninterrupted run's
weights, exactly), with MuonClip handed to Trainer (its parameters must survive the resume) and with Trainer's own
AdamW; the model starts from a released folder with MXFP4 experts, loaded dense (experts_format="dense": full
fine-tuning trains them), which training moves off the MXFP4 grid."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import Trainer, TrainingArguments

from kimi_hf.models.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration
from kimi_hf.optim import MuonClip, MuonClipCallback

from .release_format import dequantize_mxfp4, tiny_k3_config, write_k3_checkpoint


CONFIG = tiny_k3_config()
VOCAB = CONFIG["text_config"]["vocab_size"]
MEDIA = CONFIG["media_placeholder_token_id"]
PATCH = CONFIG["vision_config"]["patch_size"]
STEPS, SAVE_EVERY = 4, 2


class _Indices(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return i


def _batch(index: int) -> dict:
    """A text batch (even index) or a one-image batch (odd index), a function of the index alone: the collator holds
    no state, so a resumed run sees the batches the uninterrupted one saw."""
    gen = torch.Generator().manual_seed(index)
    if index % 2 == 0:
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        ids = ids.masked_fill(ids == MEDIA, 5)
        return {"input_ids": ids, "labels": ids.clone()}
    grid = torch.tensor([[1, 4, 4]])
    text = torch.randint(6, VOCAB, (12,), generator=gen)
    text = text.masked_fill(text == MEDIA, 7)
    ids = torch.cat([text[:3], torch.full((4,), MEDIA), text[3:]])[None]
    return {
        "input_ids": ids,
        "labels": ids.masked_fill(ids == MEDIA, -100),
        "pixel_values": torch.randn(16, 3, PATCH, PATCH, generator=gen),
        "image_grid_thw": grid,
    }


def _collate(features):
    return _batch(features[0])


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("k3_release")
    write_k3_checkpoint(folder, CONFIG, seed=0, mxfp4=True, shards=2, dtype="float32")
    return str(folder)


def _trainer(release: str, out: str, optimizer: str) -> Trainer:
    torch.manual_seed(0)
    model = KimiK3ForConditionalGeneration.from_pretrained(release, dtype=torch.float32, experts_format="dense")
    model.config.text_config.use_cache = False
    kwargs = {}
    if optimizer == "muonclip":
        opt = MuonClip.from_model(model, lr=1e-2, qk_clip_tau=100.0)
        kwargs = {"optimizers": (opt, None), "callbacks": [MuonClipCallback()]}
    args = TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        save_steps=SAVE_EVERY,  # Trainer's default save strategy ("steps"), format and limits, saved sooner
        per_device_train_batch_size=1,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=0,
    )
    return Trainer(model=model, args=args, train_dataset=_Indices(), data_collator=_collate, **kwargs)


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["muonclip", "adamw"])
def test_step_checkpoints_hold_the_release_layout_and_resume_bit_for_bit(release, tmp_path, optimizer):
    full = _trainer(release, str(tmp_path / "full"), optimizer)
    full.train()
    expected = _state(full.model)

    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE_EVERY}"
    with open(checkpoint / "config.json") as f:
        saved = json.load(f)
    assert saved["model_type"] == "kimi_k3" and saved["architectures"] == ["KimiK3ForConditionalGeneration"]
    # trained experts are off the MXFP4 grid: the default save keeps them, losslessly, as dense official tensors
    assert "quantization_config" not in saved["text_config"]
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in keys), sorted(keys)[:5]
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in keys
    assert "language_model.lm_head.weight" in keys

    resumed = _trainer(release, str(tmp_path / "resumed"), optimizer)
    before = {id(p) for p in resumed.model.parameters()}
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert {id(p) for p in resumed.model.parameters()} == before  # the optimizer's parameters are the model's
    got = _state(resumed.model)
    assert got.keys() == expected.keys()
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not different, different
    # and the run really moved the weights (the resume is not comparing two untrained models)
    start = _state(
        KimiK3ForConditionalGeneration.from_pretrained(release, dtype=torch.float32, experts_format="dense")
    )
    assert not torch.equal(
        start["model.language_model.layers.1.mlp.experts.gate_up_proj"],
        expected["model.language_model.layers.1.mlp.experts.gate_up_proj"],
    )


def test_save_model_reloads_exactly(release, tmp_path):
    trainer = _trainer(release, str(tmp_path / "run"), "adamw")
    trainer.args.max_steps = 1
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    back = KimiK3ForConditionalGeneration.from_pretrained(
        str(tmp_path / "final"), dtype=torch.float32, experts_format="dense"
    )
    mine, theirs = _state(trainer.model), _state(back)
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    assert os.stat(tmp_path / "final" / "model.safetensors").st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_untrained_experts_stay_mxfp4_and_rounding_is_asked_for(release, tmp_path):
    """The lossless default keeps MXFP4 for experts on its grid (the release's values); experts off the
    grid are saved dense with the same values, and rounded only when asked (saved_experts="mxfp4")."""
    model = KimiK3ForConditionalGeneration.from_pretrained(release, dtype=torch.float32, experts_format="dense")
    model.save_pretrained(tmp_path / "as_loaded")
    with open(tmp_path / "as_loaded" / "config.json") as f:
        assert "quantization_config" in json.load(f)["text_config"]
    released, saved = _tensors(release), _tensors(tmp_path / "as_loaded")
    packed = [k for k in released if k.endswith(".weight_packed")]
    assert packed and set(packed) <= set(saved)  # MXFP4 again (the same values; quantize_mxfp4 says which bytes)
    assert all(
        torch.equal(
            dequantize_mxfp4(saved[k], saved[k.replace("packed", "scale")]),
            dequantize_mxfp4(released[k], released[k.replace("packed", "scale")]),
        )
        for k in packed
    )
    with torch.no_grad():
        model.model.language_model.layers[1].mlp.experts.down_proj.add_(1e-3)
    model.save_pretrained(tmp_path / "rounded", saved_experts="mxfp4")
    with open(tmp_path / "rounded" / "config.json") as f:
        assert "quantization_config" in json.load(f)["text_config"]
    rounded = KimiK3ForConditionalGeneration.from_pretrained(
        tmp_path / "rounded", dtype=torch.float32, experts_format="dense"
    )
    got = rounded.model.language_model.layers[1].mlp.experts.down_proj
    moved = model.model.language_model.layers[1].mlp.experts.down_proj
    assert not torch.equal(got, moved) and (got - moved).abs().max() < 0.5 * moved.abs().max()
    model.save_pretrained(tmp_path / "lossless")
    back = KimiK3ForConditionalGeneration.from_pretrained(
        tmp_path / "lossless", dtype=torch.float32, experts_format="dense"
    )
    assert torch.equal(
        back.model.language_model.layers[1].mlp.experts.down_proj,
        model.model.language_model.layers[1].mlp.experts.down_proj,
    )


def test_load_state_dict_reads_the_release_layout_shard_by_shard(release):
    """What transformers' load_sharded_checkpoint does on resume: one load_state_dict(strict=False) per shard (a
    layer's experts may straddle two shards)."""
    from safetensors.torch import load_file

    expected = KimiK3ForConditionalGeneration.from_pretrained(release, dtype=torch.float32, experts_format="dense")
    model = KimiK3ForConditionalGeneration(expected.config).float()
    with open(os.path.join(release, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) == 2
    for shard in shards:
        model.load_state_dict(load_file(os.path.join(release, shard)), strict=False)
    a, b = _state(model), _state(expected)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # strict on a partial dict names what is missing, a single expert left out included
    with pytest.raises(RuntimeError, match="missing keys"):
        model.load_state_dict(load_file(os.path.join(release, shards[0])))
    full = {k: v for shard in shards for k, v in load_file(os.path.join(release, shard)).items()}
    model.load_state_dict(full)  # strict: every key
    del full["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_packed"]
    del full["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_scale"]
    with pytest.raises(RuntimeError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        model.load_state_dict(full)


def _tensors(folder) -> dict:
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {"save_original_format": True},
        {"save_original_format": False},
        {"max_shard_size": "20KB"},
        {"variant": "v1"},
        {"is_main_process": True, "save_peft_format": True, "token": None, "push_to_hub": False},
    ],
    ids=["original", "in_memory", "sharded", "variant", "other"],
)
def test_every_save_pretrained_keyword_reloads_the_same_model(release, tmp_path, kwargs):
    """transformers' save_pretrained keywords (its TP / EP test mixins pass save_original_format) on K3."""
    model = KimiK3ForConditionalGeneration.from_pretrained(release, dtype=torch.float32, experts_format="dense")
    model.save_pretrained(tmp_path / "out", **kwargs)
    back = KimiK3ForConditionalGeneration.from_pretrained(
        tmp_path / "out", dtype=torch.float32, variant=kwargs.get("variant"), experts_format="dense"
    )
    a, b = _state(model), _state(back)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    names = [n for n in os.listdir(tmp_path / "out") if n.endswith(".safetensors")]
    with safe_open(str(tmp_path / "out" / names[0]), "pt") as f:
        keys = list(f.keys())
    released = all(k.startswith(("language_model.", "vision_tower.", "mm_projector.")) for k in keys)
    assert released == (kwargs.get("save_original_format", True)), keys[:3]
    if "max_shard_size" in kwargs:  # sharded: the index names exactly the shards written, more than one
        with open(tmp_path / "out" / "model.safetensors.index.json") as f:
            assert sorted(set(json.load(f)["weight_map"].values())) == sorted(names) and len(names) > 1
