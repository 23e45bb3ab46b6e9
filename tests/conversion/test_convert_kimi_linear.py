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
    vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    linear_num_heads=2, linear_head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
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


def test_converted_native_model_matches_logits_and_generation(native_dir, tmp_path):
    path, native = native_dir
    out = tmp_path / "ours"
    assert convert_kimi_linear.convert(str(path), str(out)) == "kimi_hybrid_text"
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(ours, KimiHybridForCausalLM)
    x = torch.randint(3, 101, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ours(x).logits, native(x).logits
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(ours.generate(x[:, :12], **kw), native.generate(x[:, :12], **kw))


def test_round_trip_back_to_native(native_dir, tmp_path):
    path, native = native_dir
    convert_kimi_linear.convert(str(path), str(tmp_path / "ours"))
    convert_kimi_linear.convert(str(tmp_path / "ours"), str(tmp_path / "back"))
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
        convert_kimi_linear.convert(str(bad), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".convert-")] == []
    with pytest.raises(FileExistsError):
        convert_kimi_linear.convert(str(path), str(bad))
