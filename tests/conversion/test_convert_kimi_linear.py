"""Parity with transformers' native kimi_linear through conversion/convert_kimi_linear.py: a random
tiny native model, saved by transformers (Moonshot's naming), converted to ours and back."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM

from kimi_hf import KimiHybridForCausalLM


ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("convert_kimi_linear", ROOT / "conversion" / "convert_kimi_linear.py")
convert_kimi_linear = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convert_kimi_linear)

NATIVE = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    linear_num_heads=2,
    linear_head_dim=8,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
)


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**NATIVE)).eval()
    with torch.no_grad():  # non-trivial router biases so that the correction-bias path is exercised
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.05, 0.05)
    path = tmp_path_factory.mktemp("native")
    model.save_pretrained(path)
    return path, model


def test_native_checkpoint_uses_moonshot_naming(native_dir):
    path, _ = native_dir
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_conv1d.weight" in names
    assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in names)


def assert_matches_native(ours, native, x):
    """Logits within 1e-4 of the largest and the same greedy continuation of x[:, :12] (10 tokens)."""
    with torch.no_grad():
        a, b = ours(x).logits, native(x).logits
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(ours.generate(x[:, :12], **kw), native.generate(x[:, :12], **kw))


def test_converted_native_model_matches_logits_and_generation(native_dir, tmp_path):
    path, native = native_dir
    out = tmp_path / "ours"
    assert convert_kimi_linear.main([str(path), str(out), "--no-progress"])["model_type"] == "kimi_hybrid_text"
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(ours, KimiHybridForCausalLM)
    x = torch.randint(3, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    assert_matches_native(ours, native, x)


def test_round_trip_back_to_native(native_dir, tmp_path):
    path, native = native_dir
    convert_kimi_linear.main([str(path), str(tmp_path / "ours"), "--no-progress"])
    convert_kimi_linear.main([str(tmp_path / "ours"), str(tmp_path / "back"), "--no-progress"])
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == "kimi_linear"
    reloaded = KimiLinearForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = torch.randint(3, 101, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, native(x).logits)


def test_conversion_is_atomic_and_refuses_bad_input(native_dir, tmp_path):
    path, _ = native_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        convert_kimi_linear.main([str(bad), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".convert-")] == []
    with pytest.raises(FileExistsError):
        convert_kimi_linear.main([str(path), str(bad)])


def _logits(model_dir, cls, x):
    with torch.no_grad():
        return cls.from_pretrained(model_dir).eval()(x).logits


def test_sharded_in_and_out_with_index_dtype_and_summary(native_dir, tmp_path, capsys):
    path, native = native_dir
    sharded_src = tmp_path / "native_sharded"
    native.save_pretrained(sharded_src, max_shard_size="30KB")  # experts of a layer spread over shards
    assert (sharded_src / "model.safetensors.index.json").exists()
    out = tmp_path / "ours"
    summary = convert_kimi_linear.main([str(sharded_src), str(out), "--max-shard-size", "40KB", "--no-progress"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert summary["shards"] == len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "peak memory" in capsys.readouterr().out
    x = torch.randint(3, 101, (1, 20), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(_logits(out, KimiHybridForCausalLM, x), _logits(path, KimiLinearForCausalLM, x), atol=1e-4)
    half = tmp_path / "bf16"
    convert_kimi_linear.main([str(path), str(half), "--dtype", "bfloat16", "--no-progress"])
    with safe_open(str(half / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
        # what the model keeps in fp32 (kimi_hf.conversion.fp32) is not rounded: decays, short convs, router
        for kept in ("self_attn.A_log", "self_attn.q_conv1d.weight", "self_attn.o_norm.weight", "mlp.gate.weight"):
            layer = 1 if kept.startswith("mlp.") else 0  # layer 0 is dense
            assert f.get_tensor(f"model.layers.{layer}.{kept}").dtype == torch.float32, kept


@pytest.mark.parametrize("layers", ["2", "0"])
def test_verify_compares_logits_in_a_fresh_process(native_dir, tmp_path, layers):
    path, _ = native_dir
    summary = convert_kimi_linear.main(
        [str(path), str(tmp_path / "ours"), "--verify", "--verify-layers", layers, "--no-progress"]
    )
    assert summary["rel_max_diff"] < 1e-4


def _copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_wrong_inputs_name_the_tensor_or_file_and_leave_nothing(native_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path, native = native_dir
    leftovers = lambda: [p.name for p in tmp_path.iterdir() if p.name.startswith(".convert-") or p.name == "out"]  # noqa: E731
    # a shard listed in the index is missing
    sharded = tmp_path / "sharded"
    native.save_pretrained(sharded, max_shard_size="30KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        convert_kimi_linear.main([str(sharded), str(tmp_path / "out"), "--no-progress"])
    # a tensor this architecture does not have
    extra = _copy_checkpoint(path, tmp_path / "extra")
    state = load_file(extra / "model.safetensors")
    state["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(state, extra / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"unknown tensor model\.layers\.1\.self_attn\.rotary_emb\.inv_freq .*model\.safetensors"
    ):
        convert_kimi_linear.main([str(extra), str(tmp_path / "out"), "--no-progress"])
    # a config that does not match the tensors
    wrong = _copy_checkpoint(path, tmp_path / "wrong")
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["vocab_size"] = 99
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"(lm_head|model\.embed_tokens)\.weight .* shape \(101, 32\), the config implies \(99, 32\)"
    ):
        convert_kimi_linear.main([str(wrong), str(tmp_path / "out"), "--no-progress"])
    # a truncated shard
    broken = _copy_checkpoint(path, tmp_path / "broken")
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cannot read .*model.safetensors"):
        convert_kimi_linear.main([str(broken), str(tmp_path / "out"), "--no-progress"])
    # a tensor missing
    short = _copy_checkpoint(path, tmp_path / "short")
    state = load_file(short / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, short / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing .*model\.norm\.weight"):
        convert_kimi_linear.main([str(short), str(tmp_path / "out"), "--no-progress"])
    assert leftovers() == []  # nothing half-written, ever


def test_cli_help():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "conversion" / "convert_kimi_linear.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--max-shard-size" in out.stdout and "--verify" in out.stdout


def test_transformers_in_memory_layout_converts_too(native_dir, tmp_path):
    """transformers' runtime state dict (stacked conv1d, forget_gate.*, fused experts, no Moonshot
    renames), e.g. written with safetensors' save_file(model.state_dict())."""
    from safetensors.torch import save_file

    path, native = native_dir
    src = tmp_path / "runtime"
    src.mkdir()
    state = {
        k: v.contiguous()
        for k, v in native.state_dict().items()
        if k != "lm_head.weight" or not native.config.tie_word_embeddings
    }
    assert any(".forget_gate." in k for k in state) and any(k.endswith("self_attn.conv1d.weight") for k in state)
    save_file(state, src / "model.safetensors")
    (src / "config.json").write_text((path / "config.json").read_text())
    convert_kimi_linear.main([str(src), str(tmp_path / "ours"), "--no-progress"])
    x = torch.randint(3, 101, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(_logits(tmp_path / "ours", KimiHybridForCausalLM, x), native(x).logits, atol=1e-4)


def _variant(src, dst, edit):
    """A copy of checkpoint src whose tensors went through edit(state) (in place)."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _experts_removed(state, layer):
    for key in [k for k in state if k.startswith(f"model.layers.{layer}.block_sparse_moe.experts.")]:
        del state[key]


L1, L2, L3 = "model.layers.1.block_sparse_moe", "model.layers.2.block_sparse_moe", "model.layers.3.block_sparse_moe"
IN_FILE = r" \(in .*model\.safetensors\)"


@pytest.mark.parametrize(
    "case,edit,error",
    [
        (
            "expert_shape",
            lambda s: s.update({f"{L1}.experts.2.w3.weight": torch.zeros(16, 31)}),
            r"tensor model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight"
            + IN_FILE
            + r" has shape \(16, 31\), the config implies \(16, 32\)",
        ),
        (
            "shared_expert_shape",
            lambda s: s.update({f"{L2}.shared_experts.up_proj.weight": torch.zeros(8, 32)}),
            r"tensor model\.layers\.2\.block_sparse_moe\.shared_experts\.up_proj\.weight" + IN_FILE + " has shape",
        ),
        (
            "a_log_shape",
            lambda s: s.update({"model.layers.0.self_attn.A_log": torch.zeros(1, 1, 3, 1)}),
            r"tensor model\.layers\.0\.self_attn\.A_log"
            + IN_FILE
            + r" has shape \(1, 1, 3, 1\), the config implies \(1, 1, 2, 1\) or \(2,\)",
        ),
        (
            "expert_beyond_config",
            lambda s: s.update({f"{L1}.experts.4.w1.weight": torch.zeros(16, 32)}),
            r"unknown tensor model\.layers\.1\.block_sparse_moe\.experts\.4\.w1\.weight" + IN_FILE,
        ),
        (
            "expert_missing",
            lambda s: s.pop(f"{L3}.experts.1.w2.weight"),
            r"tensor model\.layers\.3\.block_sparse_moe\.experts\.1\.w2\.weight is missing",
        ),
        (
            "layer_experts_missing",
            lambda s: _experts_removed(s, 2),
            r"missing .*model\.layers\.2\.block_sparse_moe\.experts\.0\.w1\.weight",
        ),
        (
            "shared_expert_missing",
            lambda s: s.pop(f"{L2}.shared_experts.down_proj.weight"),
            r"missing .*'model\.layers\.2\.block_sparse_moe\.shared_experts\.down_proj\.weight'",
        ),
        (
            "two_spellings",
            lambda s: s.update({"model.layers.1.mlp.gate.weight": s[f"{L1}.gate.weight"].clone()}),
            r"model\.layers\.1\.(block_sparse_moe|mlp)\.gate\.weight \(in .*\) and "
            r"model\.layers\.1\.(mlp|block_sparse_moe)\.gate\.weight \(in .*\) are the same tensor",
        ),
    ],
)
def test_errors_name_the_tensor_as_the_checkpoint_spells_it(native_dir, tmp_path, case, edit, error):
    """Moonshot's naming (block_sparse_moe, per-expert w1/w2/w3, A_log [1, 1, H, 1]) is checked before
    it is renamed or stacked: errors name the user's key and file, never our name for it."""
    path, _ = native_dir
    src = _variant(path, tmp_path / case, edit)
    with pytest.raises(ValueError, match=error) as info:
        convert_kimi_linear.main([str(src), str(tmp_path / "out"), "--no-progress"])
    assert ".mlp.experts" not in str(info.value) and not (tmp_path / "out").exists()


def test_converted_directory_and_files_get_normal_permissions(native_dir, tmp_path):
    """The output is built in a temporary directory (mkdtemp: 0700) and renamed; safetensors writes its
    files 0600; a side file may be private in SRC: all end up as mkdir / open would make them."""
    import os
    import shutil
    import stat

    path, native = native_dir
    src = tmp_path / "src"
    native.save_pretrained(src, max_shard_size="30KB")
    shutil.copy(path / "generation_config.json", src / "generation_config.json")
    os.chmod(src / "generation_config.json", 0o600)
    old = os.umask(0o022)
    try:
        convert_kimi_linear.main([str(src), str(tmp_path / "out"), "--max-shard-size", "40KB", "--no-progress"])
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        f"model-00001-of-{len(modes) - 3:05d}.safetensors",
    } <= set(modes)
    assert modes == dict.fromkeys(modes, 0o644), modes
