"""Saved folders load with stock transformers and trust_remote_code=True in a fresh process where
`import kimi_hf` is impossible (auto_map + copied code), also by repo id from an offline Hugging Face
cache; the model card."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from kimi_hf import KimiHybridForCausalLM, KimiHybridForConditionalGeneration

from .helpers import tiny_config, tiny_multimodal_config, tiny_processor


WORKER = Path(__file__).with_name("remote_load_worker.py")


def save_multimodal(path):
    torch.manual_seed(0)
    model = KimiHybridForConditionalGeneration(tiny_multimodal_config()).eval()
    proc = tiny_processor()
    model.save_pretrained(path)
    proc.save_pretrained(path)
    image = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8))  # HWC uint8
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "count"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = proc(images=[image], text=text)
    with torch.no_grad():
        logits = model(**inputs).logits
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    return dict(
        kind="multimodal", image=image, text=text, input_ids=inputs["input_ids"], logits=logits, generated=generated
    )


def save_text(path):
    torch.manual_seed(1)
    model = KimiHybridForCausalLM(tiny_config()).eval()
    model.save_pretrained(path)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return dict(
        kind="text",
        input_ids=ids,
        logits=logits,
        generated=model.generate(input_ids=ids, max_new_tokens=4, do_sample=False),
    )


def save_k3(path, source):
    """A tiny Kimi K3 folder in the released layout (MXFP4 experts), loaded and saved again by our class."""
    from kimi_hf import KimiK3ForConditionalGeneration

    from ..kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint

    write_k3_checkpoint(source, tiny_k3_config(), seed=3, dtype="float32")
    model = KimiK3ForConditionalGeneration.from_pretrained(source).eval()
    model.save_pretrained(path)
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    generated = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
    return dict(kind="k3", input_ids=ids, logits=logits, generated=generated)


def offline_cache(cache, repo_id, folder):
    """The Hugging Face cache layout of a downloaded repo: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_remote_code_loads_without_kimi_hf_and_by_repo_id_offline(tmp_path):
    mm, text, k3 = tmp_path / "mm", tmp_path / "text", tmp_path / "k3"
    expected = {str(mm): save_multimodal(mm), str(text): save_text(text), str(k3): save_k3(k3, tmp_path / "k3_src")}
    assert (
        json.loads((k3 / "config.json").read_text())["auto_map"]["AutoConfig"] == "configuration_kimi_k3.KimiK3Config"
    )
    config = json.loads((mm / "config.json").read_text())
    assert (
        config["auto_map"]["AutoModelForImageTextToText"]
        == "modeling_kimi_hybrid_multimodal.KimiHybridForConditionalGeneration"
    )
    assert {"kda.py", "modeling_kimi_hybrid.py", "processing_kimi_hybrid.py"} <= set(os.listdir(mm))
    cache = tmp_path / "hub_cache"
    offline_cache(cache, "local/tiny-kimi", mm)
    expected["local/tiny-kimi"] = expected[str(mm)]
    torch.save(expected, tmp_path / "expected.pt")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "expected.pt"), str(mm), str(text), str(k3), "local/tiny-kimi"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.count("ok ") == 4


def test_model_card_describes_the_model(tmp_path):
    torch.manual_seed(0)
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert "pipeline_tag: text-generation" in card and "| 3 | MLA | MoE |" in card
    assert "trust_remote_code=True" in card and "4 layers (3 KDA, 1 MLA)" in card
    (tmp_path / "README.md").write_text("my own card")
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "my own card"  # never overwritten


def test_push_to_hub_uploads_weights_code_and_our_card(tmp_path, monkeypatch):
    """The Hub cannot be reached here: the two HfApi calls that would touch the network record what
    they are given instead; everything before them (saving, code, card) runs for real."""
    from huggingface_hub import HfApi

    uploaded = {}

    class Repo:
        repo_id = "me/tiny-kimi"

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: Repo())
    monkeypatch.setattr(
        HfApi,
        "upload_folder",
        lambda self, repo_id, folder_path, **kw: uploaded.update(
            repo_id=repo_id,
            files=sorted(os.listdir(folder_path)),
            card=open(os.path.join(folder_path, "README.md")).read(),
        ),
    )
    torch.manual_seed(0)
    KimiHybridForCausalLM(tiny_config()).push_to_hub("me/tiny-kimi")
    assert uploaded["repo_id"] == "me/tiny-kimi"
    assert {"config.json", "model.safetensors", "modeling_kimi_hybrid.py", "kda.py", "README.md"} <= set(
        uploaded["files"]
    )
    assert "| 3 | MLA | MoE |" in uploaded["card"]
    uploaded.clear()
    KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "x", push_to_hub=True, repo_id="me/tiny-kimi")
    assert "kda.py" in uploaded["files"] and "| 3 | MLA | MoE |" in uploaded["card"]


def test_saved_code_and_card_get_normal_permissions(tmp_path):
    """The copied code files and the model card are written atomically (mkstemp: 0600) but end up
    0644 under umask 022, as config.json and the weights do."""
    old = os.umask(0o022)
    try:
        KimiHybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "saved")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "saved").iterdir()}
    assert "kda.py" in modes and "README.md" in modes and "config.json" in modes
    assert modes == dict.fromkeys(modes, 0o644), modes  # no temp file left either: every name is a real file
