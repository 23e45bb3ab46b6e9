"""Smoke tests: every example runs on CPU at a small size and checks its own result; bad input is one line on
stderr and exit status 2 (kimi_hf.cli_args.ArgumentParser), before any work; no deprecated transformers API."""

import importlib.util
import os
import re
import warnings
from pathlib import Path

import pytest


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
        assert (31, 119, 180) in {color for _, color in img.convert("RGB").getcolors(640 * 400)}
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
    # past the check that a server answers (test_swarm_wide_search_exits_non_zero_when_its_runs_fail: one that does):
    # every request of the runs then fails at once
    example.check_server = lambda base_url: None
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


# transformers' deprecated aliases warn "`gradient_checkpointing_enable` is deprecated and will be removed in v6. ..."
DEPRECATED_ALIAS = re.compile(r"`\w+` is deprecated and will be removed in v\d")


def assert_no_deprecation_warnings(records):
    """None of transformers' deprecated-alias warnings (raised inside transformers, whoever called: PEFT reads
    is_gradient_checkpointing), and no FutureWarning / DeprecationWarning raised from a file of this repository."""
    root = str(EXAMPLES.parent)
    ours = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in records
        if issubclass(w.category, (FutureWarning, DeprecationWarning))
        and (DEPRECATED_ALIAS.search(str(w.message)) or (w.filename.startswith(root) and "/.venv/" not in w.filename))
    ]
    assert not ours, ours


def test_lora_finetune(tmp_path, capsys):
    import kimi_hf

    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        res = load("lora_finetune").main(["--steps", "30", "--out", str(tmp_path)])
    assert_no_deprecation_warnings(records)
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
    small_k3_model(tokenizer, "tiny", 84).save_pretrained(tmp_path / "k3", saved_experts="mxfp4")
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
        assert (31, 119, 180) in {color for _, color in img.convert("RGB").getcolors(640 * 400)}
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    assert (
        "language_model.model.layers.0.self_attention_res_proj.weight" in names
        and "language_model.lm_head.weight" in names
    )


# ---- bad input: one line naming the problem, a non-zero exit, no traceback, before any work -------------------------
@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """Folders and files the examples must refuse on one line: a missing folder, another architecture's config, a
    truncated model.safetensors (its header promises 100 bytes more than the file has), a folder that passes the
    folder check (a config, no weights: nothing loads it) beside a missing image, and a port nothing listens on."""
    import json

    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "llama").mkdir()
    (root / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for name in ("truncated", "config_only"):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"model_type": "kimi_hybrid"}))
    weights = root / "truncated" / "model.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(weights))
    os.truncate(weights, weights.stat().st_size - 100)
    return {"root": str(root), "refused": _refused_url()}


BAD_INPUT = {  # id: (example, arguments, what the one line must say)
    "lora-negative-steps": ("lora_finetune", ["--steps", "-1"], "--steps must be a positive integer, got -1"),
    "lora-missing-folder": ("lora_finetune", ["--model", "{root}/nowhere"], "--model '{root}/nowhere' does not exist"),
    "lora-other-architecture": ("lora_finetune", ["--model", "{root}/llama"], "has model_type 'llama'"),
    "lora-truncated-weights": ("lora_finetune", ["--model", "{root}/truncated"], "model.safetensors: truncated"),
    "lora-no-processor": ("lora_finetune", ["--model", "{root}/config_only"], "has no processor"),
    "generate-missing-image": (
        "generate",
        ["--model", "{root}/config_only", "--image", "{root}/nowhere.png"],
        "--image '{root}/nowhere.png' does not exist",
    ),
    "generate-other-architecture": ("generate", ["--model", "{root}/llama"], "has model_type 'llama'"),
    "generate-truncated-weights": ("generate", ["--model", "{root}/truncated"], "model.safetensors: truncated"),
    "push-missing-folder": ("push_to_hub", ["{root}/nowhere", "me/tiny"], "model_dir '{root}/nowhere' does not exist"),
    "swarm-server-unreachable": (
        "swarm_wide_search",
        ["--backend", "openai", "--model", "any", "--base-url", "{refused}", "--out", "{root}/swarm"],
        "--base-url {refused}: no server answers",
    ),
    "swarm-other-architecture": (
        "swarm_wide_search",
        ["--backend", "transformers", "--model", "{root}/llama", "--out", "{root}/swarm"],
        "has model_type 'llama'",
    ),
    "k3-from-scratch-zero-steps": ("k3_from_scratch", ["--steps", "0"], "--steps must be a positive integer, got 0"),
    "multimodal-batch-over-data": (
        "multimodal_finetune",
        ["--train", "4", "--batch", "8"],
        "--batch (8) must not exceed --train (4)",
    ),
    "pretrain-negative-lr": ("pretrain_muonclip", ["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    "kda-zero-length": ("kda_prefill_decode", ["--lengths", "0"], "--lengths must be positive integers, got [0]"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_a_non_zero_exit(case, bad_inputs, tmp_path):
    import subprocess
    import sys

    example, args, expected = BAD_INPUT[case]
    args = [a.format(**bad_inputs) for a in args]
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{example}.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"{example}.py: error: "), done.stderr
    assert expected.format(**bad_inputs) in lines[0], lines[0]
    assert not os.listdir(tmp_path)  # nothing written (outputs/ is relative to the working directory)


def test_swarm_wide_search_exits_non_zero_when_its_runs_fail(tmp_path):
    """A server that answers (the check before the runs passes) and then fails every completion: the runs end in
    "error", the table says so, and the exit status is 1: a failed comparison is no success."""
    import http.server
    import subprocess
    import sys
    import threading

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # /v1/models
            body = b'{"object": "list", "data": [{"id": "any"}]}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # /v1/chat/completions
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_error(500, "the model crashed")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "swarm_wide_search.py"), "--backend", "openai", "--model", "any"]
            + ["--base-url", url, "--modules", "2", "--out", str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "no speed-up reported: both runs must finish (single agent: error, swarm: error)" in done.stdout
    assert "HTTP 500" in done.stdout


# ---- deprecated APIs: none called by the examples and benchmarks ---------------------------------------------------
def deprecated_model_apis() -> dict[str, str]:
    """transformers' deprecated aliases on PreTrainedModel (name -> what replaces it), read off their docstrings
    ("Deprecated alias of [`~PreTrainedModel.activation_checkpointing_enable`]"): the list follows transformers."""
    import re

    from transformers import PreTrainedModel

    found = {}
    for name, value in vars(PreTrainedModel).items():
        doc = (value.fget if isinstance(value, property) else value).__doc__ or ""
        if m := re.search(r"Deprecated alias of \[`~PreTrainedModel\.(\w+)`\]", doc):
            found[name] = m.group(1)
    return found


SCRIPTS = sorted(
    str(path.relative_to(EXAMPLES.parent))
    for folder in (EXAMPLES, EXAMPLES.parent / "benchmarks")
    for path in folder.glob("*.py")
)


@pytest.mark.parametrize(
    "script",
    SCRIPTS,
)
def test_scripts_call_no_deprecated_transformers_api(script):
    """transformers 5.25 deprecates gradient_checkpointing_enable / _disable and is_gradient_checkpointing (removed in
    v6) for the activation_checkpointing_* names (the benchmarks' child programs are strings: the text is read)."""
    import re

    deprecated = deprecated_model_apis()
    assert "gradient_checkpointing_enable" in deprecated  # the docstrings still say so (else this test reads nothing)
    text = (EXAMPLES.parent / script).read_text(encoding="utf-8")
    calls = [
        f"line {text.count(chr(10), 0, m.start()) + 1}: .{m.group(1)} (use .{deprecated[m.group(1)]})"
        for m in re.finditer(r"\.(" + "|".join(deprecated) + r")\b", text)
    ]
    assert not calls, calls


def test_k3_context_memory_child_checkpoints_without_deprecation_warnings(monkeypatch):
    """The benchmark's child program as it runs (one process, T = 64, activation checkpointing on), with transformers'
    FutureWarnings turned into errors."""
    import subprocess

    monkeypatch.syspath_prepend(str(EXAMPLES.parent / "benchmarks"))
    import k3_context_memory

    monkeypatch.setenv("PYTHONWARNINGS", "error::FutureWarning")
    try:
        measured = k3_context_memory.measure(64, 64, 4, 1, True)
    except subprocess.CalledProcessError as e:  # a FutureWarning raised as an error in the child
        pytest.fail(e.stderr.decode(errors="replace")[-3000:])
    assert measured["saved"] > 0
