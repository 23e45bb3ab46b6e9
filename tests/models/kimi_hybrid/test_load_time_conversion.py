"""`KimiHybridForCausalLM.from_pretrained(dir)` of Moonshot's original Kimi Linear layout, converted while
loading (conversion_mapping_kimi_hybrid.py), against two independent references: transformers' own
KimiLinearForCausalLM on the same weights, and the offline converter's output (kimi_hf.conversion)."""

import contextlib
import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import conversion_mapping
from transformers.models.kimi_linear import KimiLinearConfig

from kimi_hf import KimiHybridForCausalLM, KimiHybridTextConfig, KimiHybridTextModel
from kimi_hf.models.kimi_hybrid.conversion_mapping_kimi_hybrid import (
    REGISTERED_CLASS,
    register,
)

from ...conversion.test_convert_kimi_linear import (  # noqa: F401  (fixture)
    NATIVE,
    assert_matches_native,
    convert_kimi_linear,
    native_dir,
)


EMPTY = dict(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(), error_msgs=[])


def _info(info: dict) -> dict:
    return {k: info[k] for k in EMPTY}


def _tokens(seed, shape=(2, 40)):
    return torch.randint(3, NATIVE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118  (safe_open has no __iter__)
    return out


@contextlib.contextmanager
def _mapping_unregistered():
    """transformers without our mapping (what a process that never imported it sees)."""
    cache = conversion_mapping._checkpoint_conversion_mapping_cache
    cache.pop(REGISTERED_CLASS)
    conversion_mapping.USER_REGISTERED_MAPPINGS.discard(REGISTERED_CLASS)
    try:
        yield
    finally:
        register()


@pytest.fixture(scope="module")
def offline_dir(native_dir, tmp_path_factory):
    """The native checkpoint through the offline converter."""
    path, _ = native_dir
    out = tmp_path_factory.mktemp("offline") / "ours"
    convert_kimi_linear.main([str(path), str(out), "--no-progress"])
    return out


def _moonshot_config() -> dict:
    """config.json as Moonshot's Kimi-Linear-48B-A3B-Instruct spells it (configuration_kimi.py's fields,
    1-based linear_attn_config layers, its auto_map), at the tiny fixture's sizes."""
    n = NATIVE
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_kimi.KimiLinearConfig",
            "AutoModel": "modeling_kimi.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM",
        },
        "model_type": "kimi_linear",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.1",
        "vocab_size": n["vocab_size"],
        "hidden_size": n["hidden_size"],
        "intermediate_size": n["intermediate_size"],
        "num_hidden_layers": n["num_hidden_layers"],
        "num_attention_heads": n["num_attention_heads"],
        "num_key_value_heads": n["num_key_value_heads"],
        "head_dim": 4,
        "hidden_act": "silu",
        "initializer_range": n["initializer_range"],
        "rms_norm_eps": 1e-5,
        "use_cache": True,
        "pad_token_id": n["pad_token_id"],
        "bos_token_id": n["bos_token_id"],
        "eos_token_id": n["eos_token_id"],
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "model_max_length": 1048576,
        "moe_intermediate_size": n["moe_intermediate_size"],
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_experts": n["num_local_experts"],
        "num_experts_per_token": n["num_experts_per_tok"],
        "num_shared_experts": n["n_shared_experts"],
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": n["n_group"],
        "topk_group": n["topk_group"],
        "q_lora_rank": None,
        "kv_lora_rank": n["kv_lora_rank"],
        "qk_nope_head_dim": n["qk_nope_head_dim"],
        "qk_rope_head_dim": n["qk_rope_head_dim"],
        "v_head_dim": n["v_head_dim"],
        "mla_use_nope": True,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3],
            "full_attn_layers": [4],
            "head_dim": n["linear_head_dim"],
            "num_heads": n["linear_num_heads"],
            "short_conv_kernel_size": 4,
        },
    }


@pytest.fixture(scope="module")
def moonshot_dir(native_dir, tmp_path_factory):
    """Moonshot's original folder: its config.json, the dense layer 0 as `mlp.*` (Moonshot's modeling_kimi.py;
    transformers' save_pretrained writes `block_sparse_moe.*` there), experts as block_sparse_moe.experts.E.w1/w2/w3,
    A_log [1, 1, H, 1], q/k/v_conv1d, in two shards with an index."""
    path, _ = native_dir
    state = load_file(path / "model.safetensors")
    state = {k.replace("model.layers.0.block_sparse_moe.", "model.layers.0.mlp."): v for k, v in state.items()}
    assert "model.layers.0.mlp.gate_proj.weight" in state and state["model.layers.0.self_attn.A_log"].shape == (
        1,
        1,
        2,
        1,
    )
    assert "model.layers.2.block_sparse_moe.experts.3.w3.weight" in state
    out = tmp_path_factory.mktemp("moonshot")
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, out / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(_moonshot_config()))
    return out


def test_native_checkpoint_loads_directly_and_matches_transformers(native_dir):
    path, native = native_dir
    ours, info = KimiHybridForCausalLM.from_pretrained(path, output_loading_info=True)
    assert _info(info) == EMPTY
    ours.eval()
    assert ours.model.layers[0].self_attn.A_log.shape == (2,)
    assert ours.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 32, 32)
    # independent of the mapping's code: expert e's gate rows are its w1, its up rows its w3, down its w2
    expert = native.model.layers[2].mlp.experts  # transformers' own load of w1/w2/w3 (stacked the same way)
    assert torch.equal(ours.model.layers[2].mlp.experts.gate_up_proj, expert.gate_up_proj)
    raw = load_file(path / "model.safetensors")
    up = ours.model.layers[3].mlp.experts.gate_up_proj[2]
    assert torch.equal(up[:16], raw["model.layers.3.block_sparse_moe.experts.2.w1.weight"])
    assert torch.equal(up[16:], raw["model.layers.3.block_sparse_moe.experts.2.w3.weight"])
    assert torch.equal(
        ours.model.layers[3].mlp.experts.down_proj[2], raw["model.layers.3.block_sparse_moe.experts.2.w2.weight"]
    )
    x = _tokens(1)
    assert_matches_native(ours, native, x)


def test_load_time_conversion_equals_the_offline_converter(native_dir, offline_dir):
    path, _ = native_dir
    direct = KimiHybridForCausalLM.from_pretrained(path).eval()
    offline = KimiHybridForCausalLM.from_pretrained(offline_dir).eval()
    _assert_same_state(direct, offline)
    x = _tokens(2)
    with torch.no_grad():
        assert torch.equal(direct(x).logits, offline(x).logits)


def test_moonshot_original_folder_loads_directly(native_dir, moonshot_dir, tmp_path):
    _, native = native_dir
    ours, info = KimiHybridForCausalLM.from_pretrained(moonshot_dir, dtype=torch.float32, output_loading_info=True)
    assert _info(info) == EMPTY
    ours.eval()
    cfg = ours.config
    assert isinstance(cfg, KimiHybridTextConfig)
    assert cfg.layer_types == NATIVE["layer_types"] and cfg.mlp_layer_types == NATIVE["mlp_layer_types"]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (4, 2, 1)
    x = _tokens(3)
    assert_matches_native(ours, native, x)
    convert_kimi_linear.main([str(moonshot_dir), str(tmp_path / "offline"), "--no-progress"])
    _assert_same_state(ours, KimiHybridForCausalLM.from_pretrained(tmp_path / "offline", dtype=torch.float32))
    # saved again: our auto_map and code, not the original folder's remote-code entries
    ours.save_pretrained(tmp_path / "saved")
    auto_map = json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_kimi_hybrid.KimiHybridTextConfig"
    assert (tmp_path / "saved" / "modeling_kimi_hybrid.py").exists()


def test_without_the_mapping_the_original_layout_does_not_load(moonshot_dir):
    """The reference for the tests above: stock loading leaves Moonshot's tensors unused."""
    with _mapping_unregistered(), pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        KimiHybridForCausalLM.from_pretrained(moonshot_dir, dtype=torch.float32)


def test_transformers_in_memory_layout_loads_too(native_dir, tmp_path):
    """forget_gate.*, one stacked conv1d and already stacked experts (save_file(model.state_dict()))."""
    path, native = native_dir
    state = {k: v.contiguous() for k, v in native.state_dict().items()}
    assert "model.layers.0.self_attn.conv1d.weight" in state and "model.layers.0.self_attn.forget_gate.A_log" in state
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    ours, info = KimiHybridForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert _info(info) == EMPTY
    _assert_same_state(ours, KimiHybridForCausalLM.from_pretrained(path))


def test_sharded_experts_and_base_model(native_dir, tmp_path):
    path, native = native_dir
    native.save_pretrained(tmp_path, max_shard_size="30KB")  # a layer's experts spread over shards
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    sharded, info = KimiHybridForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert _info(info) == EMPTY
    _assert_same_state(sharded, KimiHybridForCausalLM.from_pretrained(path))
    base, info = KimiHybridTextModel.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    assert info["unexpected_keys"] <= {"lm_head.weight"}
    x = _tokens(4)
    with torch.no_grad():
        h, ref = base.eval()(x).last_hidden_state, native.model(x).last_hidden_state
        assert (h - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_half_precision_keeps_the_gates_in_fp32(native_dir, offline_dir):
    path, _ = native_dir
    direct = KimiHybridForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    attn, moe = direct.model.layers[0].self_attn, direct.model.layers[1].mlp
    assert attn.A_log.dtype == attn.dt_bias.dtype == attn.q_conv1d.weight.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.gate_up_proj.dtype == attn.q_proj.weight.dtype == torch.bfloat16
    _assert_same_state(direct, KimiHybridForCausalLM.from_pretrained(offline_dir, dtype=torch.bfloat16))


def test_save_pretrained_writes_our_layout_and_reloads(moonshot_dir, offline_dir, tmp_path):
    """Load-only transforms: the saved folder holds what the offline converter writes, and loads without
    the mapping."""
    loaded = KimiHybridForCausalLM.from_pretrained(moonshot_dir, dtype=torch.float32)
    loaded.save_pretrained(tmp_path / "saved")
    saved, offline = _weights(tmp_path / "saved"), _weights(offline_dir)
    assert sorted(saved) == sorted(offline)
    for k in offline:
        assert torch.equal(saved[k], offline[k]), k
    assert saved["model.layers.0.self_attn.A_log"].shape == (2,)
    assert not any("block_sparse_moe" in k or ".w1." in k for k in saved)
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert cfg["model_type"] == "kimi_hybrid_text" and cfg["architectures"] == ["KimiHybridForCausalLM"]
    x = _tokens(5)
    with _mapping_unregistered():
        reloaded, info = KimiHybridForCausalLM.from_pretrained(tmp_path / "saved", output_loading_info=True)
    assert _info(info) == EMPTY
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(x).logits, loaded.eval()(x).logits)
    # saving again (a model loaded from our layout) changes nothing either
    reloaded.save_pretrained(tmp_path / "again")
    again = _weights(tmp_path / "again")
    assert sorted(again) == sorted(saved) and all(torch.equal(again[k], saved[k]) for k in saved)


def test_a_model_built_from_a_config_saves_our_layout(tmp_path):
    """transformers reverts every registered mapping when saving a model that was not loaded."""
    native = KimiLinearConfig(**NATIVE).to_dict()
    cfg = KimiHybridTextConfig(
        **{k: v for k, v in native.items() if k not in ("model_type", "architectures", "transformers_version")}
    )
    model = KimiHybridForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    saved = _weights(tmp_path)
    state = model.state_dict()
    assert sorted(saved) == sorted(state)
    assert all(saved[k].shape == state[k].shape for k in state)


@pytest.mark.parametrize(
    "case,edit,pattern",
    [
        (
            "missing_expert",
            lambda s: s.pop("model.layers.3.block_sparse_moe.experts.1.w2.weight"),
            "ignore_mismatched_sizes",
        ),
        # a failed conversion: a ValueError naming the parameter (transformers' own is a generic RuntimeError)
        (
            "missing_gate_half",
            lambda s: s.pop("model.layers.3.block_sparse_moe.experts.1.w1.weight"),
            "experts.gate_up_proj",
        ),
        (
            "extra_expert",
            lambda s: s.update({"model.layers.1.block_sparse_moe.experts.4.w2.weight": torch.zeros(32, 16)}),
            "ignore_mismatched_sizes",
        ),
        (
            "a_log_heads",
            lambda s: s.update({"model.layers.0.self_attn.A_log": torch.zeros(1, 1, 3, 1)}),
            "ignore_mismatched_sizes",
        ),
    ],
)
def test_inconsistent_checkpoints_are_refused(native_dir, tmp_path, case, edit, pattern):
    path, _ = native_dir
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises((RuntimeError, ValueError), match=pattern):
        KimiHybridForCausalLM.from_pretrained(tmp_path)


def test_importing_the_package_registers_the_mapping():
    code = (
        "import kimi_hf, transformers.conversion_mapping as c; "
        f"assert {REGISTERED_CLASS!r} in c.USER_REGISTERED_MAPPINGS"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
