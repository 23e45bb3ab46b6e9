"""`kimi-hf plan` as a user runs it: the released Kimi K3 config.json (no weights anywhere), one JSON object with
--json, one-line errors naming the flag before any model is built."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_hf.cli import main


ROOT = Path(__file__).resolve().parents[2]
K3_CONFIG = ROOT / "examples" / "k3_released_config.json"  # moonshotai/Kimi-K3's config.json, verbatim


def run(*args):
    return subprocess.run([sys.executable, "-m", "kimi_hf", "plan", *args], capture_output=True, text=True, cwd=ROOT)


def released() -> str:
    return str(K3_CONFIG)


def test_released_k3_inference_plan_as_json():
    """The whole released K3 (2.8 T parameters) on meta: the resident experts' bytes are 1.45 TB of its 1.56 TB."""
    done = run(released(), "--task", "infer", "--ep", "16", "--gpus", "16", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    plan = json.loads(line)
    assert set(plan["per_rank"]) >= {"weights", "adapters", "gradients", "optimizer", "activations", "total"}
    # fsdp left out: the 16 data ranks (the trainer's rule, kimi_hf.distributed.ParallelDims)
    assert plan["layout"] == {"world": 16, "tp": 1, "ep": 16, "pp": 1, "fsdp": 16, "cp": 1, "dp_replicate": 1}
    assert 1.5e12 < plan["total_weights"] < 1.6e12  # MXFP4: 4.25 bits an expert weight
    # 16 ranks share the weights: the experts by ep (over tp x fsdp), the rest by fsdp
    assert plan["total_weights"] / 16 <= plan["per_rank"]["weights"] < plan["total_weights"] / 14
    assert plan["per_rank"]["gradients"] == plan["per_rank"]["optimizer"] == 0
    assert plan["fits"] is (plan["per_rank"]["total"] <= plan["usable_memory"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ep", "3"], "--ep 3 does not divide num_experts (896)"),
        (["--tp", "5", "--gpus", "5"], "--tp 5 does not divide num_attention_heads (96)"),
        (["--tp", "8", "--gpus", "12"], "--pp 1 x --tp 8 = 8 does not divide --gpus 12"),
        (["--tp", "8", "--fsdp", "2", "--gpus", "16"], "--tp 8 with --fsdp 2"),  # as the trainer refuses it
        (["--task", "full", "--experts-format", "mxfp4"], "--task full trains the routed experts"),
        (["--pp", "94", "--gpus", "94"], "--pp 94 leaves a pipeline stage without layers"),
    ],
)
def test_bad_flags_are_one_line_errors(args, message, capsys):
    assert main(["plan", released(), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("kimi-hf: error: ") and message in err and "\n" not in err, err


@pytest.mark.parametrize("value", ["lots", "141gb", "0", "5XB"])
def test_a_bad_gpu_memory_is_a_usage_error_naming_the_flag(value, capsys):
    """--gpu-memory is read by argparse (kimi_hf.sizes, as every size flag): exit 2 before the config is read; "141gb"
    is bits to transformers, so it is refused rather than read as 141 x 10^9 bytes."""
    assert main(["plan", released(), "--gpu-memory", value]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("kimi-hf plan: error: argument --gpu-memory: ") and repr(value) in line, line


@pytest.mark.parametrize("as_json", [False, True])
def test_a_plan_that_does_not_fit_exits_1_after_printing_it(as_json, capsys):
    """The verdict is the exit status (as --suggest finding no layout is): the table or the JSON is printed on stdout,
    then one line on stderr and status 1. 16 x 141GB fit the released K3's inference (the first test); 16 x 50GB
    do not."""
    args = ["--task", "infer", "--ep", "16", "--gpus", "16", "--gpu-memory", "50GB"]
    assert main(["plan", released(), *args, *(["--json"] if as_json else [])]) == 1
    out, err = capsys.readouterr()
    if as_json:
        [line] = out.strip().splitlines()
        plan = json.loads(line)
        assert plan["fits"] is False and plan["usable_memory"] == int(50e9 * 0.92)
    else:
        assert "does NOT fit" in out
    [line] = err.splitlines()
    assert line.startswith("kimi-hf: error: the job does not fit: ") and "--suggest" in line, line


def test_a_config_of_another_architecture_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["plan", str(tmp_path)]) == 1
    assert "model_type 'llama' is not one this planner models" in capsys.readouterr().err
