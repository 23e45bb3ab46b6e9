"""The `kimi-hf` command: the console script, `python -m kimi_hf`, and each subcommand's entry."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from kimi_hf.cli import main, run

SCRIPT = Path(sys.executable).parent / "kimi-hf"


def shell(*args, timeout=600):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_console_script_and_module_print_usage():
    assert SCRIPT.exists(), "pip install -e . creates the kimi-hf console script"
    for cmd in ([str(SCRIPT), "--help"], [sys.executable, "-m", "kimi_hf", "--help"]):
        r = shell(*cmd)
        assert r.returncode == 0 and "kimi-hf quickstart" in r.stdout and "kimi-hf convert" in r.stdout


def test_subcommand_help_and_errors(capsys):
    for argv in (["convert", "kimi-linear", "--help"], ["convert", "k25-vision", "--help"], ["serve", "--help"],
                 ["quickstart", "--help"]):
        with pytest.raises(SystemExit) as e:
            run(argv)
        assert e.value.code == 0, argv
    assert "--max-shard-size" in capsys.readouterr().out
    assert main(["bench", "qk_clip", "--help"]) == 0  # runs benchmarks/qk_clip.py in a subprocess
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="unknown command 'fly'"):
        main(["fly"])
    with pytest.raises(SystemExit, match="usage: kimi-hf convert"):
        main(["convert", "nothing"])
    with pytest.raises(SystemExit, match="usage: kimi-hf bench"):
        main(["bench"])


def test_quickstart_end_to_end_from_the_command_line(tmp_path):
    out = tmp_path / "qs"
    r = shell(str(SCRIPT), "quickstart", "--size", "tiny", "--steps", "3", "--batch-size", "4",
            "--text-examples", "16", "--image-examples", "16", "--eval-images", "4", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    for step in ("[1/6]", "[4/6]", "[6/6]", "model + processor:", "loss plot:"):
        assert step in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reload_max_logit_diff"] < 1e-4 and summary["steps"] == 3 and summary["device"] == "cpu"
    assert summary["image_answer"] is not None and 0 <= summary["held_out_counting_accuracy"] <= 1
    assert Image.open(out / "loss.png").size == (640, 400)
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "kda.py"} <= set(os.listdir(out / "model"))


def test_quickstart_rejects_bad_arguments():
    from kimi_hf.quickstart import run_quickstart

    with pytest.raises(ValueError, match="steps"):
        run_quickstart(steps=0)
    with pytest.raises(ValueError, match="batch_size"):
        run_quickstart(batch_size=16, text_examples_n=2, image_examples_n=2)
    with pytest.raises(ValueError, match="size"):
        run_quickstart(size="huge", steps=1, text_examples_n=1, image_examples_n=1, eval_images=1)
