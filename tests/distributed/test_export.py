"""The streaming export (kimi_hf.distributed.export, `examples/k3_finetune.py --export`): a LoRA run's merged model and
a full fine-tuning run's model, written in K3's released layout from the sharded checkpoint, reload to the logits of
the trained model; the reference reads the checkpoint with torch's own converter (dcp_to_torch_save), not the
export's reader. The folder is the package's atomic output folder (normal modes, nothing half-written, the
converters' shard names); an existing one is replaced only with --overwrite (overwrite=True)."""

from __future__ import annotations

import ast
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


def no_umask(*args):
    raise AssertionError("os.umask called: setting the process umask races with other threads' file creation")


def modes(folder: Path) -> dict[str, int]:
    """{path relative to folder's parent: permission bits} of folder and everything in it."""
    out = {folder.name: os.stat(folder).st_mode & 0o777}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder.parent)] = os.stat(path).st_mode & 0o777
    return out


def assert_normal_modes(folder: Path) -> None:
    got = modes(folder)
    assert all(m == (0o755 if os.path.isdir(folder.parent / k) else 0o644) for k, m in got.items()), got


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture(scope="module")
def lora_run(k3_folder, tmp_path_factory) -> Path:
    """2 LoRA steps (rank 4) of the example with a checkpoint in ck/ and the export in merged/, under umask 022."""
    root = tmp_path_factory.mktemp("lora_run")
    old = os.umask(0o022)
    try:
        train_and_export(k3_folder, "--lora", root / "ck", root / "merged", "--lora-rank", "4")
    finally:
        os.umask(old)
    return root


def logits(model) -> torch.Tensor:
    x = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=x, use_cache=False).logits


def test_lora_export_is_the_merged_model(k3_folder, lora_run, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES

    ck, out = lora_run / "ck", lora_run / "merged"
    assert sorted(os.listdir(lora_run)) == ["ck", "merged"]  # no temporary folder left beside it
    assert_normal_modes(out)
    assert sorted(os.listdir(out)) == sorted(os.listdir(k3_folder))  # the source's shards, index and side files
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
    # fp32 rounding of (W + BA) x against W x + B (A x) through the layers: 2.3e-5 measured (transformers 5.25)
    torch.testing.assert_close(logits(exported), expected, atol=5e-5, rtol=1e-5)
    # everything the adapters do not touch is the released folder's, bit for bit (the MXFP4 bytes included)
    src, dst = tensors(k3_folder), tensors(out)
    assert src.keys() == dst.keys()
    changed = {k for k in src if not torch.equal(src[k], dst[k])}
    assert changed and all(k.endswith(".weight") and ".experts." not in k for k in changed)  # no routed expert
    assert any(k.endswith("weight_packed") for k in src)


def test_full_export_reloads_the_trained_weights(k3_folder, tmp_path, umask_022):
    from transformers import AutoModelForImageTextToText

    from kimi_hf.conversion.safetensors_stream import shard_names
    from kimi_hf.distributed.export import export_full

    ck, out = tmp_path / "ck", tmp_path / "full"
    train_and_export(k3_folder, "--full", ck, out)
    assert sorted(os.listdir(tmp_path)) == ["ck", "full"]
    assert_normal_modes(out)
    assert "model.safetensors" in os.listdir(out)  # one shard: transformers' single-file name, no index
    # the example's --overwrite (resumed at the last step: no step to run, the export alone)
    args = ["--model", str(k3_folder), "--full", "--steps", "2", "--data", "random", "--seq-len", "32", "--resume"]
    example().main([*args, "--checkpoint-dir", str(ck), "--export", str(out), "--overwrite"])
    # the library, into small shards named as the converters and transformers name them
    export_full(str(ck / "step-2"), str(k3_folder), str(out), max_shard_size=400_000, overwrite=True)
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) > 1 and shards == shard_names(len(shards))
    with open(out / "model.safetensors.index.json", encoding="utf-8") as f:
        assert sorted(set(json.load(f)["weight_map"].values())) == shards
    assert sorted(os.listdir(tmp_path)) == ["ck", "full"]
    assert_normal_modes(out)
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


def test_an_existing_export_folder_needs_overwrite(k3_folder, lora_run, tmp_path, umask_022, monkeypatch):
    """Refused without overwrite (naming the folder and the flag); an overwrite that fails half way leaves the old
    folder as it was and no temporary folder; one that succeeds replaces it (no umask set on the way)."""
    from kimi_hf.distributed import export

    step, out = str(lora_run / "ck" / "step-2"), tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError) as info:
        export.export_lora(step, str(k3_folder), str(out), scaling=2.0)
    assert str(out) in str(info.value) and "--overwrite" in str(info.value)
    real, calls = export.save_file, []

    def write_one_shard_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("No space left on device")
        real(*args, **kwargs)

    monkeypatch.setattr(export, "save_file", write_one_shard_then_fail)
    with pytest.raises(OSError, match="No space left"):
        export.export_lora(step, str(k3_folder), str(out), scaling=2.0, overwrite=True)
    assert os.listdir(out) == ["old.txt"] and os.listdir(tmp_path) == ["out"]
    monkeypatch.setattr(export, "save_file", real)
    monkeypatch.setattr(os, "umask", no_umask)
    assert export.export_lora(step, str(k3_folder), str(out), scaling=2.0, overwrite=True)["merged"] > 0
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["out"]
    assert sorted(os.listdir(out)) == sorted(os.listdir(lora_run / "merged"))
    assert all((out / f).read_bytes() == (lora_run / "merged" / f).read_bytes() for f in os.listdir(out))
    assert_normal_modes(out)
    # never a folder that holds the checkpoint or the model
    with pytest.raises(ValueError, match="which holds the checkpoint"):
        export.check_export_dir(str(lora_run), str(k3_folder), step, overwrite=True)


def test_the_example_refuses_an_existing_export_folder_before_training(k3_folder, tmp_path, capsys):
    out, ck = tmp_path / "out", tmp_path / "ck"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    args = ["--model", str(k3_folder), "--lora", "--steps", "1", "--data", "random", "--seq-len", "32"]
    with pytest.raises(SystemExit) as exit_info:
        example().main([*args, "--checkpoint-dir", str(ck), "--export", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(out) in err and "--overwrite" in err, err
    assert not ck.exists() and os.listdir(out) == ["keep.txt"]  # refused before any step


def test_the_export_uses_only_public_names_of_other_modules():
    tree = ast.parse((ROOT / "kimi_hf" / "distributed" / "export.py").read_text())
    private = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("kimi_hf"))
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []


def test_export_needs_the_checkpoint(k3_folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        example().main(["--model", str(k3_folder), "--export", str(tmp_path / "x")])
    assert "--export needs --checkpoint-dir" in capsys.readouterr().err
