"""conversion/convert_kimi_k25_vision.py: a K2.5 checkpoint saved by transformers (Moonshot's naming:
fused wqkv in RoPE-interleaved order, norm0/fc0/wo, proj.0/proj.2) + our text checkpoint -> one
early-fusion checkpoint whose image features equal K2.5's own."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

from kimi_hf import KimiHybridForCausalLM, KimiHybridForConditionalGeneration

from ..models.kimi_hybrid.helpers import TINY, TINY_VISION, tiny_config


ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "convert_kimi_k25_vision", ROOT / "conversion" / "convert_kimi_k25_vision.py"
)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

K25_TEXT = dict(
    model_type="deepseek_v3",
    vocab_size=120,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    first_k_dense_replace=1,
)


def k25_checkpoint(path, text_hidden):
    torch.manual_seed(0)
    cfg = Kimi_K25Config(
        text_config=dict(K25_TEXT, hidden_size=text_hidden),
        vision_config=TINY_VISION,
        projection_hidden_size=TINY_VISION["hidden_size"],
        image_token_id=7,
    )
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.model.vision_tower.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(path)
    return model


def test_image_features_equal_k25_and_text_is_untouched(tmp_path):
    k25 = k25_checkpoint(tmp_path / "k25", text_hidden=TINY["hidden_size"])
    with safe_open(str(tmp_path / "k25" / "model.safetensors"), "pt") as f:
        assert "vision_tower.encoder.blocks.0.wqkv.weight" in f.keys()  # Moonshot's naming on disk
    torch.manual_seed(1)
    text = KimiHybridForCausalLM(tiny_config()).eval()
    text.save_pretrained(tmp_path / "text")
    summary = tool.main(
        [
            str(tmp_path / "text"),
            str(tmp_path / "k25"),
            str(tmp_path / "mm"),
            "--image-token-id",
            "5",
            "--max-shard-size",
            "50KB",
            "--no-progress",
        ]
    )
    assert summary["notes"] == [] and summary["shards"] > 1
    mm = KimiHybridForConditionalGeneration.from_pretrained(tmp_path / "mm").eval()
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    pv = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = torch.cat(k25.model.get_image_features(pv, grid).pooler_output)
        ours = torch.cat(mm.get_image_features(pv, grid).pooler_output)
        assert (ours - ref).abs().max() < 1e-5
        ids = torch.tensor([[1, 9, 17, 33, 2]])
        assert torch.allclose(mm(input_ids=ids).logits, text(input_ids=ids).logits, atol=1e-6)
    assert json.loads((tmp_path / "mm" / "config.json").read_text())["image_token_id"] == 5


def test_projector_of_another_hidden_size_is_left_out_with_a_note(tmp_path, capsys):
    k25_checkpoint(tmp_path / "k25", text_hidden=48)
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "text")
    summary = tool.main(
        [str(tmp_path / "text"), str(tmp_path / "k25"), str(tmp_path / "mm"), "--image-token-id", "5", "--no-progress"]
    )
    assert len(summary["notes"]) == 1 and "out_proj" in capsys.readouterr().out
    mm = KimiHybridForConditionalGeneration.from_pretrained(tmp_path / "mm")
    assert mm.model.mm_projector.out_proj.weight.shape == (TINY["hidden_size"], 4 * TINY_VISION["hidden_size"])


def test_refuses_wrong_inputs(tmp_path):
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "text")
    with pytest.raises(ValueError, match="kimi_k25"):
        tool.main([str(tmp_path / "text"), str(tmp_path / "text"), str(tmp_path / "mm"), "--no-progress"])
    assert not (tmp_path / "mm").exists()


def test_cli_help():
    import subprocess

    out = subprocess.run(
        [sys.executable, str(ROOT / "conversion" / "convert_kimi_k25_vision.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--image-token-id" in out.stdout


def test_wrong_tensors_are_named_as_the_checkpoints_spell_them(tmp_path):
    """A mis-shaped K2.5 tensor is named by its K2.5 key and file (not by the name it would get in our
    model), and a text checkpoint missing a tensor is refused instead of written incomplete."""
    from safetensors.torch import load_file, save_file

    k25_checkpoint(tmp_path / "k25", text_hidden=TINY["hidden_size"])
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "text")
    shard = tmp_path / "k25" / "model.safetensors"
    state = load_file(shard)
    state["vision_tower.encoder.blocks.1.mlp.fc0.weight"] = torch.zeros(60, TINY_VISION["hidden_size"])
    save_file(state, shard)
    args = [
        str(tmp_path / "text"),
        str(tmp_path / "k25"),
        str(tmp_path / "mm"),
        "--image-token-id",
        "5",
        "--no-progress",
    ]
    with pytest.raises(
        ValueError,
        match=r"tensor vision_tower\.encoder\.blocks\.1\.mlp\.fc0\.weight "
        r"\(in .*k25/model\.safetensors\) has shape \(60, 32\)",
    ):
        tool.main(args)
    k25_checkpoint(tmp_path / "k25", text_hidden=TINY["hidden_size"])  # intact again
    shard = tmp_path / "text" / "model.safetensors"
    state = load_file(shard)
    del state["model.layers.2.mlp.shared_experts.up_proj.weight"]
    save_file(state, shard, metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"missing from .*text, e\.g\. "
        r"\['model\.layers\.2\.mlp\.shared_experts\.up_proj",
    ):
        tool.main(args)
    assert not (tmp_path / "mm").exists()
