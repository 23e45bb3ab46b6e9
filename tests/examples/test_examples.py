"""Smoke tests: every example runs on CPU at a small size and checks its own result."""

import importlib.util
import os
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kda_prefill_decode(capsys):
    worst = load("kda_prefill_decode").main(
        ["--lengths", "70", "5", "130", "--decode", "3", "--heads", "2", "--head-dim", "16"]
    )
    assert worst <= 1e-4
    assert "decode continues prefill" in capsys.readouterr().out


def test_multimodal_finetune(tmp_path, capsys):
    """A few Trainer steps end to end: data, tokenizer, MuonClip, held-out generation, plot, save.
    (The accuracy well above chance needs the default 1500 steps: see the example's docstring.)"""
    import re

    from PIL import Image

    acc = load("multimodal_finetune").main(
        ["--steps", "4", "--train", "64", "--eval", "8", "--batch", "8", "--seed", "3", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    printed = re.search(r"held-out accuracy (\d\.\d{3}) \(seed 3; chance 0\.\d\d\) on 8 scenes", out)
    assert printed is not None, out
    assert float(printed.group(1)) == round(acc, 3) and acc * 8 == round(acc * 8)  # a share of the 8 scenes
    plot = tmp_path / "multimodal.png"
    assert f"loss plot: {plot}" in out and "matplotlib" not in out
    with Image.open(plot) as img:  # a real PNG with the loss curve drawn (one logged loss per step here)
        assert img.format == "PNG" and img.size == (640, 400)
        assert (31, 119, 180) in set(img.convert("RGB").getdata())
    assert (tmp_path / "model" / "config.json").exists() and (tmp_path / "model" / "processor_config.json").exists()


def test_swarm_wide_search(tmp_path, capsys):
    rows = load("swarm_wide_search").main(
        ["--modules", "8", "--per-agent", "2", "--step-latency", "0.02", "--out", str(tmp_path)]
    )
    single, swarm = rows["single agent"], rows["swarm"]
    assert single["quality"] == swarm["quality"] == 1.0
    assert (single["critical_steps"], swarm["critical_steps"]) == (9, 1 + 3 + 1)
    assert swarm["num_subagents"] == 4 and swarm["total_steps"] == 2 + 4 * 3
    assert (tmp_path / "serial.jsonl").exists() and (tmp_path / "swarm.jsonl").exists()
    out = capsys.readouterr().out
    assert "| swarm | finished |" in out
    assert "critical steps: 1.8x fewer with the swarm; wall time " in out
    assert "quality 1.00 (single agent) vs 1.00 (swarm)" in out


def _refused_url():
    """The URL of a local port nothing listens on: a real backend whose every request fails at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_swarm_wide_search_reports_no_speed_up_for_failed_or_unfinished_runs(tmp_path, capsys):
    """Runs that fail at their first step (or are cut short by the step budget) are fast for the wrong
    reason: their time ratio ("5.6x" at quality 0) is not printed as a speed-up."""
    example = load("swarm_wide_search")
    rows = example.main(
        [
            "--modules",
            "8",
            "--backend",
            "openai",
            "--model",
            "any",
            "--base-url",
            _refused_url(),
            "--out",
            str(tmp_path / "failed"),
        ]
    )
    out = capsys.readouterr().out
    assert rows["single agent"]["status"] == rows["swarm"]["status"] == "error"
    assert "x fewer" not in out and "wall time" not in out
    assert "no speed-up reported: both runs must finish (single agent: error, swarm: error)" in out
    assert "quality 0.00 (single agent) vs 0.00 (swarm)" in out and "single agent: BackendError" in out
    # a budget of 2 steps per agent: the serial agent (8 reads + the answer) is cut short, the swarm's
    # sub-agents (1 read + the answer) and orchestrator (assign + answer) are not
    example.main(
        [
            "--modules",
            "8",
            "--per-agent",
            "1",
            "--max-steps",
            "2",
            "--step-latency",
            "0",
            "--out",
            str(tmp_path / "budget"),
        ]
    )
    out = capsys.readouterr().out
    assert (
        "no speed-up reported: both runs must finish (single agent: orchestrator_step_budget, swarm: finished)"
    ) in out
    assert "vs 1.00 (swarm)" in out and "x fewer" not in out


def test_generate_streams_text_and_answers_about_an_image(quickstart_model, tmp_path, capsys):
    import random

    from kimi_hf.scenes import render_scene

    image = tmp_path / "scene.png"
    render_scene(random.Random(0), 84, circles=2).save(image)
    argv = ["--model", quickstart_model, "--max-new-tokens", "6", "--image", str(image)]
    out = load("generate").main(argv)
    printed = capsys.readouterr().out
    # the reply and the answer streamed, each on its line after its prompt (K3: the response channel only)
    assert out.keys() == {"text", "answer"}
    expected = f"> Write some Python.\n{out['text']}\n\n> [{image}] How many circles are there?\n{out['answer']}\n"
    assert printed == expected
    # greedy: printed at the end instead of streamed, the same replies and the same output
    assert load("generate").main([*argv, "--no-stream"]) == out
    assert capsys.readouterr().out == expected


def test_push_to_hub_dry_run_and_upload(quickstart_model, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    folder = load("push_to_hub").main([quickstart_model, "me/tiny", "--dry-run", str(tmp_path / "up")])
    files = set(os.listdir(folder))
    assert {
        "config.json",
        "model.safetensors",
        "modeling_kimi_hybrid.py",
        "kda.py",
        "README.md",
        "processor_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    } <= files
    uploaded = {}

    class Repo:
        repo_id = "me/tiny"

    # the Hub is not reachable here: the two network calls record their arguments
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: Repo())
    monkeypatch.setattr(
        HfApi,
        "upload_folder",
        lambda self, repo_id, folder_path, **kw: (
            uploaded.update(repo_id=repo_id, files=set(os.listdir(folder_path)))
            or "https://huggingface.co/me/tiny/commit/x"
        ),
    )
    load("push_to_hub").main([quickstart_model, "me/tiny"])
    assert uploaded["repo_id"] == "me/tiny" and uploaded["files"] == files


def assert_adapter_loads_with_auto_peft(adapter: Path, base_class: str, targets: list[str]):
    """The adapter folder alone loads with PEFT's AutoPeftModelForCausalLM (kimi_hf imported): task_type="CAUSAL_LM"
    in its config (without one PEFT imports the base class's module, kimi_hf's, which its allowlist refuses), the base
    model from base_model_name_or_path, and the trained LoRA weights."""
    import json

    import torch
    from peft import AutoPeftModelForCausalLM, PeftModelForCausalLM, get_peft_model_state_dict
    from safetensors.torch import load_file

    model = AutoPeftModelForCausalLM.from_pretrained(adapter)
    assert isinstance(model, PeftModelForCausalLM) and type(model.get_base_model()).__name__ == base_class
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and sorted(config["target_modules"]) == sorted(targets)
    saved, loaded = load_file(adapter / "adapter_model.safetensors"), get_peft_model_state_dict(model)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in saved.items())  # trained (B starts at 0)


def test_lora_finetune(tmp_path, capsys):
    import kimi_hf

    res = load("lora_finetune").main(["--steps", "30", "--out", str(tmp_path)])
    assert res["reload_diff"] < 1e-4 and res["merge_diff"] < 1e-3
    assert res["adapter_kb"] < 2000
    assert "| + LoRA (30 steps) |" in capsys.readouterr().out
    assert_adapter_loads_with_auto_peft(
        tmp_path / "adapter", "KimiHybridForConditionalGeneration", kimi_hf.LORA_TARGET_MODULES
    )


def test_lora_finetune_kimi_k3(tmp_path):
    """The example on a (tiny) Kimi K3 folder in the released layout (MXFP4 experts, resident): K3's LoRA targets,
    and the adapter loads with AutoPeftModelForCausalLM
    as well (AutoModelForCausalLM is registered for K3's config: KimiK3ForConditionalGeneration; PEFT has no
    image-text-to-text auto class)."""
    import torch

    import kimi_hf
    from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES
    from kimi_hf.presets import small_k3_model
    from kimi_hf.tokenization import train_tokenizer

    example = load("lora_finetune")
    rows = example.examples(0)
    corpus = [r["messages"][0]["content"] + " " + r["messages"][1]["content"] for r in rows] * 4
    tokenizer = train_tokenizer(corpus, vocab_size=400, markup="k3")
    torch.manual_seed(0)
    # the released layout: MXFP4 experts (the random init rounded to MXFP4), loaded resident by the example
    small_k3_model(tokenizer, "tiny", 84).save_pretrained(tmp_path / "k3", experts_format="mxfp4")
    kimi_hf.KimiK3Processor(kimi_hf.KimiK3ImageProcessor(), tokenizer).save_pretrained(tmp_path / "k3")
    res = example.main(["--model", str(tmp_path / "k3"), "--steps", "10", "--out", str(tmp_path / "lora")])
    assert res["experts_format"] == "mxfp4"
    assert res["reload_diff"] < 1e-4 and res["merge_diff"] < 1e-3
    assert_adapter_loads_with_auto_peft(
        tmp_path / "lora" / "adapter", "KimiK3ForConditionalGeneration", K3_LORA_TARGET_MODULES
    )


def test_k3_from_scratch(tmp_path, capsys):
    """A few Trainer + MuonClip steps of a K3-architecture model; saved in K3's released names, reloaded through
    AutoModelForCausalLM with the same greedy tokens."""
    import json

    from PIL import Image
    from safetensors import safe_open

    losses, same = load("k3_from_scratch").main(
        ["--steps", "6", "--batch", "4", "--seq", "64", "--out", str(tmp_path)]
    )
    assert same and losses[-1] < losses[0]
    out = capsys.readouterr().out
    assert f"loss plot: {tmp_path / 'k3_loss.png'}" in out
    with Image.open(tmp_path / "k3_loss.png") as img:  # a real PNG with the loss curve drawn
        assert img.format == "PNG" and img.size == (640, 400)
        assert (31, 119, 180) in set(img.convert("RGB").getdata())
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    assert (
        "language_model.model.layers.0.self_attention_res_proj.weight" in names
        and "language_model.lm_head.weight" in names
    )
