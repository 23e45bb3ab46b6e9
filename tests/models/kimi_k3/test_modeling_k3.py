"""Kimi K3 from a folder in the released layout (written by release_format.py): configs read field by field,
`from_pretrained` with nothing missing / unexpected / mismatched (MXFP4 experts dequantised, A_log narrowed,
the K3 prefixes and Attention Residual names), logits, images and greedy decoding against the independent fp64
reference (reference.py), fp32-kept tensors under bf16, and the errors bad checkpoints and configs get."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

import kimi_hf  # noqa: F401  (registers the Auto classes)
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import KimiHybridTextConfig
from kimi_hf.models.kimi_k3.configuration_kimi_k3 import KimiK3Config, KimiK3TextConfig
from kimi_hf.models.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration, KimiK3Model

from .reference import k3_reference_greedy, k3_reference_logits
from .release_format import tiny_k3_config, write_k3_checkpoint


REL = 1e-4  # fp32 model vs the fp64 reference, relative (Frobenius) error of the logits; observed ~2e-6


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def load(folder, **kwargs):
    model, info = KimiK3ForConditionalGeneration.from_pretrained(folder, output_loading_info=True, **kwargs)
    return model.eval(), info


def assert_clean(info):
    assert {k: list(v) for k, v in info.items()} == dict(
        missing_keys=[], unexpected_keys=[], mismatched_keys=[], error_msgs=[]
    )


def text_ids(config, B=2, T=11, seed=0):
    vocab = config["text_config"]["vocab_size"]
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    return ids.masked_fill(ids == config["media_placeholder_token_id"], 5)


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory):
    config = tiny_k3_config()
    folder = tmp_path_factory.mktemp("k3_fp32")
    return str(folder), config, write_k3_checkpoint(folder, config, seed=1, mxfp4=True, dtype="float32")


def test_released_configs_are_read_field_by_field(k3_config):
    config = KimiK3Config(**k3_config)
    text = config.text_config
    lac = k3_config["text_config"]["linear_attn_config"]
    assert [i + 1 for i, t in enumerate(text.layer_types) if t == "linear_attention"] == lac["kda_layers"]
    assert [i + 1 for i, t in enumerate(text.layer_types) if t == "full_attention"] == lac["full_attn_layers"]
    assert text.kda_gate_lower_bound == lac["gate_lower_bound"] and text.kda_full_rank_output_gate
    assert text.attn_residual == "block"
    assert text.attn_residual_block_size == 2 * k3_config["text_config"]["attn_res_block_size"]
    assert text.hidden_act == "situ" and text.mla_use_output_gate and text.latent_moe_use_norm
    assert config.image_token_id == k3_config["media_placeholder_token_id"]
    # written back in the released names: every architecture field of the release, same values
    out = config.to_dict()
    for key in ("model_type", "architectures", "media_placeholder_token_id", "image_placeholder", "eos_token_id"):
        assert out[key] == k3_config[key], key
    released = k3_config["text_config"]
    for key, value in out["text_config"].items():
        if key in released and key != "dtype":
            assert value == released[key], key
    assert out["text_config"]["model_type"] == "kimi_linear"
    assert out["text_config"]["quantization_config"] == released["quantization_config"]
    assert KimiK3Config(**out).to_dict() == out


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4, 5]), "linear_attn_config"),
        (lambda t: t["linear_attn_config"].update(full_attn_layers=[4, 6, 8]), "full_attn_layers"),
        (lambda t: t.update(attn_res_block_size=0), "attn_res_block_size"),
        (lambda t: t.update(hidden_act="swishy"), "hidden_act"),
        (lambda t: t.update(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (lambda t: t.update(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
        (lambda t: t.update(some_new_architecture_field=3), "some_new_architecture_field"),
        (lambda t: t["linear_attn_config"].update(gate_lower_bound=1.0), "gate_lower_bound"),
        (lambda t: t["linear_attn_config"].update(new_kda_switch=True), "new_kda_switch"),
        (lambda t: t["quantization_config"].update(format="nvfp4-pack-quantized"), "quantization_config"),
    ],
)
def test_bad_configs_name_the_field(change, field):
    config = tiny_k3_config()
    change(config["text_config"])
    with pytest.raises(ValueError, match=field):
        KimiK3Config(**config)


def test_the_hybrid_config_understands_k3_fields_instead_of_dropping_them(k3_config):
    text = dict(k3_config["text_config"])
    text.pop("quantization_config")
    cfg = KimiHybridTextConfig(**text)
    assert cfg.hidden_act == "situ" and cfg.kda_gate_lower_bound == -5.0 and cfg.attn_residual == "block"
    assert cfg.model_type == "kimi_hybrid_text"  # not the folder's "kimi_linear"


# with latent_moe_use_norm the latent norm cancels routed_scaling_factor and the renormalisation: those are
# tested with the norm off; "kimi_linear_path" turns every K3 option off (softplus gate, low-rank output gate,
# no MLA gate, plain residual, experts at the full width)
VARIANTS = {
    "k3": {},
    "norm_off_scaling": dict(latent_moe_use_norm=False, routed_scaling_factor=2.5, moe_renormalize=False),
    "kimi_linear_path": dict(
        linear_attn_config=dict(use_full_rank_gate=False, gate_lower_bound=None),
        mla_use_output_gate=False,
        attn_res_block_size=None,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
    ),
    "no_q_lora_silu": dict(q_lora_rank=None, hidden_act="silu"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mxfp4", [True, False])
def test_loads_the_released_layout_and_matches_the_reference(tmp_path, mxfp4, variant):
    config = tiny_k3_config(**VARIANTS[variant])
    tensors = write_k3_checkpoint(tmp_path, config, seed=2, mxfp4=mxfp4, dtype="float32")
    model, info = load(tmp_path, dtype=torch.float32)
    assert_clean(info)
    ids = text_ids(config)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert rel_err(logits, k3_reference_logits(config, tensors, ids)) < REL


def test_k3_with_its_options_off_is_the_hybrid_model(tmp_path):
    """One code path: the K3 classes with every K3 option off compute what KimiHybridForCausalLM computes with the
    same weights (the Kimi Linear model)."""
    from kimi_hf import KimiHybridForCausalLM

    config = tiny_k3_config(**VARIANTS["kimi_linear_path"])
    write_k3_checkpoint(tmp_path, config, seed=6, dtype="float32")
    k3, _ = load(tmp_path, dtype=torch.float32, experts_format="dense")  # the hybrid model holds them dense
    text = {k: v for k, v in config["text_config"].items() if k != "quantization_config"}
    hybrid = KimiHybridForCausalLM(KimiHybridTextConfig(**text)).eval()
    state = {"model." + k: v for k, v in k3.model.language_model.state_dict().items()}
    state["lm_head.weight"] = k3.lm_head.weight
    assert hybrid.load_state_dict(state, strict=True)
    ids = text_ids(config)
    with torch.no_grad():  # the same kernels; fp32 summation order may differ by an ulp between the two wrappers
        torch.testing.assert_close(hybrid(input_ids=ids).logits, k3(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_images_at_the_placeholders_match_the_reference(fp32_checkpoint):
    folder, config, tensors = fp32_checkpoint
    model, _ = load(folder, dtype=torch.float32)
    grid = torch.tensor([[1, 4, 6], [1, 8, 8]])
    patches = int(grid.prod(-1).sum())
    pixel_values = torch.randn(patches, 3, 14, 14, generator=torch.Generator().manual_seed(3))
    media = config["media_placeholder_token_id"]
    n = [6, 16]  # h * w / 4 per image
    row0 = torch.cat([torch.tensor([7, 8]), torch.full((n[0],), media), torch.tensor([9, 10, 11])])
    row1 = torch.cat([torch.full((n[1],), media), torch.tensor([12] * 3)])
    T = max(len(row0), len(row1))
    ids = torch.stack(
        [torch.cat([row0, torch.full((T - len(row0),), 13)]), torch.cat([row1, torch.full((T - len(row1),), 14)])]
    )
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid).logits
    ref = k3_reference_logits(config, tensors, ids, pixel_values, grid)
    assert rel_err(logits, ref) < REL


def test_greedy_generation_with_the_cache_equals_the_reference(fp32_checkpoint):
    folder, config, tensors = fp32_checkpoint
    model, _ = load(folder, dtype=torch.float32)
    ids = text_ids(config, B=1, T=9, seed=4)
    ours = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, k3_reference_greedy(config, tensors, ids, 6))


def test_bf16_load_keeps_the_fp32_tensors_of_the_release(k3_checkpoint):
    resident, info = load(k3_checkpoint.folder, dtype=torch.bfloat16)  # the experts stay bytes under any dtype
    assert_clean(info)
    assert resident.model.language_model.layers[1].mlp.experts.gate_up_proj.dtype == torch.uint8
    model, info = load(k3_checkpoint.folder, dtype=torch.bfloat16, experts_format="dense")
    assert_clean(info)
    kept = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight")
    kept += ("e_score_correction_bias",)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in tensors.items():
        if name.endswith(kept):
            assert t.dtype == torch.float32, name
    assert model.model.language_model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_auto_classes_load_the_folder(k3_checkpoint):
    config = AutoConfig.from_pretrained(k3_checkpoint.folder)
    assert type(config) is KimiK3Config and config.model_type == "kimi_k3"
    assert isinstance(config.text_config, KimiK3TextConfig)
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        model = auto.from_pretrained(k3_checkpoint.folder)
        assert type(model) is KimiK3ForConditionalGeneration
    # AutoModel: the base model (transformers' convention; the release's own auto_map names the full class),
    # every tensor but the head loaded (MXFP4 experts decoded), no remote code asked for
    base, info = AutoModel.from_pretrained(k3_checkpoint.folder, dtype=torch.float32, output_loading_info=True)
    assert type(base) is KimiK3Model
    assert {k: list(v) for k, v in info.items() if k != "unexpected_keys"} == dict(
        missing_keys=[], mismatched_keys=[], error_msgs=[]
    )
    full = AutoModelForCausalLM.from_pretrained(k3_checkpoint.folder, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.equal(base(input_ids=ids).last_hidden_state, full.model(input_ids=ids).last_hidden_state)


def test_every_experts_implementation_loads_and_agrees(fp32_checkpoint):
    """from_pretrained(experts_implementation=...) reaches the decoder's experts (transformers checks the choice in
    every sub-model: the vision tower, which has none, accepts it), and set_experts_implementation switches them;
    eager, grouped_mm and batched_mm give the same logits (fp32, tolerance 1e-5; observed 7e-6)."""
    folder, config, _ = fp32_checkpoint
    ids = text_ids(config)
    logits = {}
    for impl in ("eager", "grouped_mm", "batched_mm"):
        model, info = load(folder, dtype=torch.float32, experts_implementation=impl)
        assert_clean(info)
        assert model.config._experts_implementation == model.config.text_config._experts_implementation == impl
        with torch.no_grad():
            logits[impl] = model(input_ids=ids).logits
    model.set_experts_implementation("eager")
    assert model.config.text_config._experts_implementation == "eager"
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits["eager"])
    for impl in ("grouped_mm", "batched_mm"):
        torch.testing.assert_close(logits[impl], logits["eager"], atol=1e-5, rtol=1e-5)


def _rewrite(folder, edit):
    """Applies edit(name, tensor) -> tensor | None (None drops it) to every tensor of a written checkpoint."""
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    for shard in sorted(set(index["weight_map"].values())):
        path = os.path.join(folder, shard)
        tensors = {}
        for name, t in load_file(path).items():
            t = edit(name, t)
            if t is not None:
                tensors[name] = t
        save_file(tensors, path, metadata={"format": "pt"})


def test_nonzero_a_log_padding_is_refused_by_name(tmp_path):
    write_k3_checkpoint(tmp_path, tiny_k3_config(), seed=0, dtype="float32")
    target = "language_model.model.layers.0.self_attn.A_log"

    def edit(name, t):
        if name == target:
            t = t.clone()
            t[-1] = 0.5
        return t

    _rewrite(tmp_path, edit)
    with pytest.raises(Exception, match="A_log"):
        load(tmp_path)


def test_mxfp4_scale_of_the_wrong_width_is_refused_by_name(tmp_path):
    write_k3_checkpoint(tmp_path, tiny_k3_config(), seed=0, dtype="float32")

    def edit(name, t):
        return t[:, :-1].contiguous() if name.endswith("experts.3.w2.weight_scale") else t

    _rewrite(tmp_path, edit)
    with pytest.raises(Exception, match="experts.down_proj|w2.weight_packed|weight_scale"):
        load(tmp_path)


def _read_all(folder) -> dict:
    index = os.path.join(folder, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    out = {}
    for name in files:
        out.update(load_file(os.path.join(folder, name)))
    return out


def test_save_pretrained_writes_the_released_layout_and_reloads(k3_checkpoint, tmp_path):
    from .release_format import dequantize_mxfp4

    model, _ = load(k3_checkpoint.folder, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    original, saved = _read_all(k3_checkpoint.folder), _read_all(tmp_path)
    assert saved.keys() == original.keys()  # the official names, nothing else
    for name, t in original.items():
        assert saved[name].dtype == t.dtype and saved[name].shape == t.shape, name
        if name.endswith(
            "weight_packed"
        ):  # re-packed: the same values (a group's bytes may differ, see quantize_mxfp4)
            scale = name.replace("weight_packed", "weight_scale")
            assert torch.equal(dequantize_mxfp4(saved[name], saved[scale]), dequantize_mxfp4(t, original[scale])), name
        elif not name.endswith("weight_scale"):
            assert torch.equal(saved[name], t), name
    a_log = saved["language_model.model.layers.0.self_attn.A_log"]
    heads = k3_checkpoint.config["text_config"]["linear_attn_config"]["num_heads"]
    assert a_log.shape == (k3_checkpoint.config["text_config"]["linear_attn_config"]["head_dim"],)
    assert not a_log[heads:].any()
    config = json.load(open(tmp_path / "config.json"))
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"] and config["model_type"] == "kimi_k3"
    assert config["text_config"]["model_type"] == "kimi_linear"
    for key, value in k3_checkpoint.config["text_config"].items():
        if key in config["text_config"] and key != "dtype":
            assert config["text_config"][key] == value, key
    reloaded, info = load(tmp_path, dtype=torch.bfloat16)
    assert_clean(info)
    ids = text_ids(k3_checkpoint.config)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_save_with_dense_experts_says_so_in_the_config(k3_checkpoint, tmp_path):
    model, _ = load(k3_checkpoint.folder, dtype=torch.bfloat16, experts_format="dense")
    model.save_pretrained(tmp_path, saved_experts="dense")
    saved = _read_all(tmp_path)
    assert not any(k.endswith(("weight_packed", "weight_scale")) for k in saved)
    assert saved["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.bfloat16
    assert "quantization_config" not in json.load(open(tmp_path / "config.json"))["text_config"]
    assert model.config.text_config.experts_quantization_config is not None  # the model's config is unchanged
    reloaded, info = load(tmp_path, dtype=torch.bfloat16)
    assert_clean(info)
    ids = text_ids(k3_checkpoint.config)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    with pytest.raises(ValueError, match="saved_experts must be"):
        model.save_pretrained(tmp_path / "x", saved_experts="int4")
    with pytest.raises(TypeError, match="takes saved_experts="):  # the in-memory name, refused before any write
        model.save_pretrained(tmp_path / "y", experts_format="mxfp4")
    assert not (tmp_path / "y").exists()


def test_batched_generation_with_left_padding_equals_each_row_alone(fp32_checkpoint):
    folder, config, _ = fp32_checkpoint
    model, _ = load(folder, dtype=torch.float32)
    pad = config["pad_token_id"]
    rows = [text_ids(config, B=1, T=T, seed=10 + T)[0] for T in (5, 9)]
    T = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.full((T - len(r),), pad), r]) for r in rows])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(r) for r in rows])[:, None]).long()
    kwargs = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=pad)
    batched = model.generate(ids, attention_mask=mask, **kwargs)
    for i, r in enumerate(rows):
        alone = model.generate(r[None], **kwargs)
        assert torch.equal(batched[i, -5:], alone[0, -5:]), i
