"""PEFT LoRA adapters of Kimi K3 in the released checkpoint's names (kimi_hf.adapters_released), against a tiny K3
checkpoint written in the release's layout by an independent writer (tests/models/kimi_k3/release_format.py): every
adapter key names a weight of that checkpoint with the factors' shapes, target_modules select exactly the adapted
modules in the release's module tree and in ours, the adapter loads back (PeftModel.from_pretrained, transformers'
load_adapter, PeftModel.load_adapter) to the very tensors it was saved from, and merged into the released folder by
name it gives the PEFT model's logits. The adapters' B factors are random (init_lora_weights=False), so that a factor
that landed on the wrong module changes the logits."""

import contextlib
import glob
import json
import os
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file

from kimi_hf import K3_LORA_TARGET_MODULES, KimiK3ForCausalLM, KimiK3ForConditionalGeneration
from kimi_hf.adapters_released import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    merge_released_adapter,
    released_adapter_state_dict,
    released_module_name,
    save_released_adapter,
)
from kimi_hf.atomic_io import normal_mode

from .models.kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint


PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A tiny K3 folder in the release's layout (fp32, MXFP4 experts, 2 shards) and its tensors' shapes by name."""
    folder = tmp_path_factory.mktemp("k3_release")
    write_k3_checkpoint(folder, tiny_k3_config(), seed=0, mxfp4=True, shards=2, dtype="float32")
    shapes = {}
    for path in glob.glob(str(folder / "*.safetensors")):
        with safe_open(path, "pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return str(folder), shapes


def base(release):
    return KimiK3ForConditionalGeneration.from_pretrained(release[0]).eval()


def lora(model, targets, **kwargs):
    torch.manual_seed(0)
    config = dict(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)  # random A and B
    return get_peft_model(model, LoraConfig(**{**config, **kwargs})).eval()


# two rows of text around an image each (grid 1 x 4 x 6: 6 placeholders), so the tower's adapters count too
MEDIA = tiny_k3_config()["media_placeholder_token_id"]
GRID = torch.tensor([[1, 4, 6], [1, 4, 6]])
PIXELS = torch.randn(48, 3, 14, 14, generator=torch.Generator().manual_seed(2))
TEXT = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(1))
TEXT[TEXT == MEDIA] = 5
IDS = torch.cat([TEXT[:, :3], torch.full((2, 6), MEDIA), TEXT[:, 3:]], dim=1)


def logits(model, image: bool = True):
    with torch.no_grad():
        if not image:
            return model(IDS.masked_fill(IDS == MEDIA, 5)).logits
        return model(input_ids=IDS, pixel_values=PIXELS, image_grid_thw=GRID).logits


def adapter(model, name="default") -> dict:
    """A model's adapter tensors under PEFT's saved names (`base_model.model.` prefixed, whichever way it was
    injected)."""
    state = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    return {(k if k.startswith(PREFIX) else PREFIX + k): v for k, v in state.items()}


@contextlib.contextmanager
def no_missing_key_warning():
    """PEFT only warns about adapter keys it could not place: here that is an error."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*missing adapter keys.*")
        warnings.filterwarnings("error", message=".*unexpected keys.*")
        yield


def module_tree(names) -> set[str]:
    """Every module name of a tree of tensor names (their proper prefixes)."""
    out = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


def selected(entries, modules) -> set[str]:
    """PEFT's rule: a module is targeted when its name is an entry or ends with "." + entry."""
    return {m for m in modules if any(m == e or m.endswith("." + e) for e in entries)}


@pytest.mark.parametrize("targets", ["recommended", "all-linear"])
def test_every_key_names_a_released_weight_and_target_modules_select_the_adapted_modules(release, tmp_path, targets):
    folder, shapes = release
    model = lora(base(release), K3_LORA_TARGET_MODULES if targets == "recommended" else "all-linear")
    out = save_released_adapter(model, str(tmp_path / "adapter"))
    assert sorted(os.listdir(out)) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    for name in os.listdir(out):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == normal_mode()  # 0644 under umask 022
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == folder and config["peft_type"] == "LORA"
    tensors = load_file(os.path.join(out, ADAPTER_WEIGHTS))
    released_modules = set()
    for key, t in tensors.items():
        module, _, factor = key.removeprefix(PREFIX).partition(".lora_")
        out_features, in_features = shapes[module + ".weight"]  # a KeyError: not a weight of the release
        assert tuple(t.shape) == ((4, in_features) if factor == "A.weight" else (out_features, 4)), key
        released_modules.add(module)
    ours = {k.removeprefix(PREFIX).partition(".lora_")[0] for k in adapter(model)}
    assert len(released_modules) == len(ours) == len(tensors) // 2
    # the vision tower's and the projector's too under "all-linear"
    assert any(m.startswith("vision_tower.encoder.blocks.") for m in released_modules) == (targets == "all-linear")
    # target_modules: exactly the adapted modules, in the release's module tree and in ours
    assert selected(config["target_modules"], module_tree(shapes)) == released_modules
    ours_tree = {n for n, _ in base(release).named_modules() if n}
    assert selected(config["target_modules"], ours_tree) == ours
    if targets == "recommended":  # K3's recommended leaves are the release's
        assert config["target_modules"] == sorted(K3_LORA_TARGET_MODULES)


@pytest.mark.parametrize("targets", ["recommended", "all-linear"])
def test_loads_back_to_the_saved_tensors_and_logits(release, tmp_path, targets):
    model = lora(base(release), K3_LORA_TARGET_MODULES if targets == "recommended" else "all-linear")
    saved, expected = adapter(model), logits(model)
    save_released_adapter(model, str(tmp_path / "adapter"))
    # PeftModel.from_pretrained: the key map KimiK3ForConditionalGeneration carries (_checkpoint_conversion_mapping)
    with no_missing_key_warning():
        peft = PeftModel.from_pretrained(base(release), str(tmp_path / "adapter")).eval()
    loaded = adapter(peft)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    torch.testing.assert_close(logits(peft), expected, rtol=0, atol=0)
    # transformers' load_adapter: K3's conversion mapping
    model = base(release)
    info = model.load_adapter(str(tmp_path / "adapter"))
    assert not info.missing_keys and not info.unexpected_keys
    loaded = adapter(model)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    torch.testing.assert_close(logits(model), expected, rtol=0, atol=0)
    # saved again from there (an adapter injected by load_adapter): the same folder
    save_released_adapter(model, str(tmp_path / "again"))
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes(), name
    # a second adapter on a PeftModel: PeftModel.load_adapter takes the key map as its one argument
    key_mapping = peft.get_base_model()._checkpoint_conversion_mapping
    peft.load_adapter(str(tmp_path / "adapter"), adapter_name="again", key_mapping=key_mapping)
    again = adapter(peft, "again")
    assert all(torch.equal(again[k], saved[k]) for k in saved)


def test_merged_into_the_released_folder_by_name_gives_the_peft_models_logits(release, tmp_path):
    """An all-linear adapter (the tower's and the projector's too, an image in the input) merged into the release's
    own tensors by their names (W + alpha / r B A, fp32), the folder loaded with from_pretrained: the PEFT model's
    logits. Folding B A into W changes the summation order: observed 6e-5 on logits of about 4 (fp32), tolerance
    2e-4 (the vision adapters alone move the logits by 5)."""
    model = lora(base(release), "all-linear", lora_alpha=16, rank_pattern={"q_a_proj": 8})
    expected = logits(model)
    save_released_adapter(model, str(tmp_path / "adapter"))
    info = merge_released_adapter(str(tmp_path / "adapter"), release[0], str(tmp_path / "merged"))
    assert info["merged"] == len(adapter(model)) // 2
    merged = KimiK3ForConditionalGeneration.from_pretrained(str(tmp_path / "merged")).eval()
    assert merged.experts_format == "mxfp4"  # the experts' bytes copied as released
    got = logits(merged)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-4)
    assert (logits(base(release)) - expected).abs().max() > 0.1  # the adapter matters


def test_rank_and_alpha_patterns_are_written_in_both_trees(release, tmp_path):
    model = lora(base(release), K3_LORA_TARGET_MODULES, rank_pattern={"q_a_proj": 8}, alpha_pattern={"kv_b_proj": 2})
    save_released_adapter(model, str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["rank_pattern"] == {"q_a_proj": 8} and config["alpha_pattern"] == {"kv_b_proj": 2}
    peft = PeftModel.from_pretrained(base(release), str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(logits(peft), logits(model), rtol=0, atol=0)


def test_an_adapter_folder_in_our_names_converts_like_the_model(release, tmp_path):
    model = lora(base(release), "all-linear")
    model.save_pretrained(tmp_path / "ours")
    save_released_adapter(model, str(tmp_path / "from_model"))
    save_released_adapter(str(tmp_path / "ours"), str(tmp_path / "from_folder"))  # base: base_model_name_or_path
    a = load_file(str(tmp_path / "from_model" / ADAPTER_WEIGHTS))
    b = load_file(str(tmp_path / "from_folder" / ADAPTER_WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "from_model" / ADAPTER_CONFIG).read_text() == (
        tmp_path / "from_folder" / ADAPTER_CONFIG
    ).read_text()


def test_the_text_only_model_writes_the_releases_names_and_loads_them_back(release, tmp_path):
    """KimiK3ForCausalLM (`model.*`, `lm_head`): the release's `language_model.model.*` names, loaded back through
    its own key map."""
    multimodal = base(release)
    text = KimiK3ForCausalLM(multimodal.config.text_config).eval()
    text.model.load_state_dict(multimodal.model.language_model.state_dict())
    text.lm_head.load_state_dict(multimodal.lm_head.state_dict())
    model = lora(text, [*K3_LORA_TARGET_MODULES, "lm_head"])
    save_released_adapter(model, str(tmp_path / "adapter"))
    keys = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS)).keys()
    assert all(k.startswith(PREFIX + "language_model.") for k in keys)
    assert PREFIX + "language_model.lm_head.lora_A.weight" in keys
    peft = PeftModel.from_pretrained(
        KimiK3ForCausalLM(multimodal.config.text_config).eval(), str(tmp_path / "adapter")
    )
    assert all(torch.equal(v, adapter(model)[k]) for k, v in adapter(peft).items())
    # the release's class takes it too: the same logits as the text model with the adapter
    onto = PeftModel.from_pretrained(base(release), str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(logits(onto, image=False), logits(model, image=False), rtol=0, atol=1e-5)


def test_names_of_ours_and_the_releases():
    from kimi_hf import KimiK3Config

    config = KimiK3Config.from_dict(tiny_k3_config())
    for ours, released in [
        ("model.language_model.layers.3.self_attn.q_a_proj", "language_model.model.layers.3.self_attn.q_a_proj"),
        (
            "model.language_model.layers.1.mlp.shared_experts.gate_proj",
            "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj",
        ),
        ("model.language_model.layers.0.mlp.gate_proj", "language_model.model.layers.0.mlp.gate_proj"),  # dense
        ("model.vision_tower.layers.0.attn.qkv_proj", "vision_tower.encoder.blocks.0.wqkv"),
        ("model.vision_tower.layers.1.mlp.fc2", "vision_tower.encoder.blocks.1.mlp.fc1"),
        ("model.mm_projector.proj.0", "mm_projector.proj.0"),
        ("lm_head", "language_model.lm_head"),
    ]:
        assert released_module_name(ours, config) == released


def test_what_has_no_released_form_is_refused_by_name(release, tmp_path):
    # LoRA over the stacked routed experts (target_parameters): the release stores them expert by expert
    model = lora(base(release), None, target_parameters=["mlp.experts.down_proj"], init_lora_weights=True)
    with pytest.raises(ValueError, match=r"target_parameters.*experts\.E\.w1"):
        save_released_adapter(model, str(tmp_path / "experts"))
    state = {PREFIX + "model.language_model.layers.1.mlp.experts.lora_A.weight": torch.zeros(4, 64)}
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts.*target_parameters"):
        released_adapter_state_dict(state, base(release).config)
    # whole-module copies
    model = lora(base(release), ["q_a_proj"], modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match="modules_to_save"):
        save_released_adapter(model, str(tmp_path / "copies"))
    assert not os.path.exists(tmp_path / "experts") and not os.path.exists(tmp_path / "copies")


def test_the_output_folder(release, tmp_path):
    model = lora(base(release), ["q_a_proj"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        save_released_adapter(model, str(tmp_path / "file"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite"):
        save_released_adapter(model, str(tmp_path / "full"))
    save_released_adapter(model, str(tmp_path / "full"), overwrite=True)
    assert sorted(os.listdir(tmp_path / "full")) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    (tmp_path / "empty").mkdir()
    save_released_adapter(model, str(tmp_path / "empty"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".adapter-")]  # no temporary folder left
