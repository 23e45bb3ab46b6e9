"""The streaming export (kimi_hf.distributed.export, `examples/k3_finetune.py --export`): a LoRA run's merged model and
a full fine-tuning run's model, written in K3's released layout from the sharded checkpoint, reload to the logits of
the trained model; the reference reads the checkpoint with torch's own converter (dcp_to_torch_save), not the
export's reader."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


ROOT = Path(__file__).resolve().parents[2]


def example():
    spec = importlib.util.spec_from_file_location("k3_finetune", ROOT / "examples" / "k3_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def k3_folder(tmp_path_factory) -> Path:
    from tests.models.kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint

    folder = tmp_path_factory.mktemp("k3_release")
    write_k3_checkpoint(folder, tiny_k3_config(), seed=0, mxfp4=True, shards=3, dtype="float32")
    return folder


def train_and_export(k3_folder, mode: str, ck, out, *extra: str) -> None:
    """examples/k3_finetune.py: 2 steps on random tokens, a checkpoint in ck, the export in out."""
    args = ["--model", str(k3_folder), mode, "--steps", "2", "--data", "random", "--seq-len", "32", *extra]
    example().main([*args, "--checkpoint-dir", str(ck), "--export", str(out)])


def trained_state(step_dir: Path, tmp_path: Path) -> dict:
    dcp_to_torch_save(str(step_dir), str(tmp_path / "ck.pt"))
    return torch.load(tmp_path / "ck.pt", weights_only=False)["train"]["model"]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    with open(folder / "model.safetensors.index.json", encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def logits(model) -> torch.Tensor:
    x = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def test_lora_export_is_the_merged_model(k3_folder, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES

    ck, out = tmp_path / "ck", tmp_path / "merged"
    train_and_export(k3_folder, "--lora", ck, out, "--lora-rank", "4")
    assert not (tmp_path / "merged.tmp").exists()
    assert all((os.stat(out / f).st_mode & 0o777) == 0o644 for f in os.listdir(out))
    # the reference: the base model with the trained adapters, unmerged
    base = AutoModelForImageTextToText.from_pretrained(k3_folder, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=K3_LORA_TARGET_MODULES))
    state = trained_state(ck / "step-2", tmp_path)
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    assert adapters and all(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)  # trained
    missing, unexpected = peft.load_state_dict(adapters, strict=False)
    assert not unexpected
    expected = logits(peft.eval())
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert exported.experts_format == "mxfp4"
    torch.testing.assert_close(logits(exported), expected, atol=2e-5, rtol=1e-5)
    # everything the adapters do not touch is the released folder's, bit for bit (the MXFP4 bytes included)
    src, dst = tensors(k3_folder), tensors(out)
    assert src.keys() == dst.keys()
    changed = {k for k in src if not torch.equal(src[k], dst[k])}
    assert changed and all(k.endswith(".weight") and ".experts." not in k for k in changed)  # no routed expert
    assert any(k.endswith("weight_packed") for k in src)


def test_full_export_reloads_the_trained_weights(k3_folder, tmp_path):
    from transformers import AutoModelForImageTextToText

    ck, out = tmp_path / "ck", tmp_path / "full"
    train_and_export(k3_folder, "--full", ck, out)
    model = AutoModelForImageTextToText.from_pretrained(k3_folder, dtype=torch.float32, experts_format="dense")
    state = trained_state(ck / "step-2", tmp_path)
    model.load_state_dict(state, strict=True)
    exported = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    assert exported.experts_format == "dense"  # trained experts are off the MXFP4 grid: written as .weight
    for name, p in exported.state_dict().items():
        torch.testing.assert_close(p, model.state_dict()[name], atol=0, rtol=0, msg=name)
    torch.testing.assert_close(logits(exported), logits(model), atol=0, rtol=0)
    with open(out / "config.json", encoding="utf-8") as f:
        assert "quantization_config" not in json.load(f)["text_config"]


def test_export_needs_the_checkpoint(k3_folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        example().main(["--model", str(k3_folder), "--export", str(tmp_path / "x")])
    assert "--export needs --checkpoint-dir" in capsys.readouterr().err
