"""The `kimi-hf` command: the console script, `python -m kimi_hf`, and each subcommand's entry."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image
from safetensors import safe_open
from transformers import AutoProcessor

import kimi_hf
from kimi_hf.cli import BENCHMARKS, CLAIMS, main, quickstart_parser, run
from kimi_hf.scenes import counting_examples


SCRIPT = Path(sys.executable).parent / "kimi-hf"
ROOT = Path(__file__).resolve().parents[1]


def shell(*args, timeout=600, **env):
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1", **env}
    )


def one_line_error(text: str, prefix: str = "kimi-hf: error: ") -> str:
    """The error of a failed command: exactly one line on stderr, no traceback."""
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in text, text
    return lines[0]


def test_console_script_and_module_print_usage():
    assert SCRIPT.exists(), "pip install -e . creates the kimi-hf console script"
    for cmd in ([str(SCRIPT), "--help"], [sys.executable, "-m", "kimi_hf", "--help"]):
        r = shell(*cmd)
        assert r.returncode == 0 and "kimi-hf quickstart" in r.stdout and "kimi-hf convert" in r.stdout


def test_help_does_not_import_torch_or_transformers():
    # `import kimi_hf` imports (and registers) the models, seconds of torch + transformers; the command's own
    # process defers that to first use, so --help and usage errors are instant
    for cmd in (
        [str(SCRIPT), "--help"],
        [str(SCRIPT), "quickstart", "--help"],
        [str(SCRIPT), "serve", "--help"],
        [str(SCRIPT), "plan", "--help"],
        [str(SCRIPT), "bench", "--help"],
        ["-m", "kimi_hf", "--version"],
    ):
        r = shell(sys.executable, "-X", "importtime", *cmd)
        assert r.returncode == 0, r.stderr[-2000:]
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
        assert "kimi_hf" in imported and not {"torch", "transformers"} & imported, cmd


def test_the_command_still_registers_the_auto_classes_on_first_use():
    code = (
        "import sys; sys.argv[0] = 'kimi-hf'; import kimi_hf; assert 'torch' not in sys.modules; "
        "from transformers import AutoConfig; kimi_hf.KimiHybridConfig; "
        "print(type(AutoConfig.for_model('kimi_hybrid')).__name__)"
    )
    r = shell(sys.executable, "-c", code)
    assert r.returncode == 0 and r.stdout.strip() == "KimiHybridConfig", r.stderr[-2000:]
    from transformers import AutoConfig  # and here, in a plain `import kimi_hf`

    assert type(AutoConfig.for_model("kimi_hybrid")) is kimi_hf.KimiHybridConfig


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kimi-hf {kimi_hf.__version__}\n"


@pytest.mark.parametrize(
    "argv, usage",
    [
        (["--help"], "usage: kimi-hf [-h] [--version] COMMAND"),
        (["quickstart", "--help"], "usage: kimi-hf quickstart [-h]"),
        (["convert", "--help"], "usage: kimi-hf convert [-h] CONVERTER"),
        (["convert", "kimi-linear", "--help"], "usage: kimi-hf convert kimi-linear [-h]"),
        (["convert", "k25-vision", "--help"], "usage: kimi-hf convert k25-vision [-h]"),
        (["bench", "--help"], "usage: kimi-hf bench [-h] NAME"),
        (["serve", "--help"], "usage: kimi-hf serve [-h]"),
        (["plan", "--help"], "usage: kimi-hf plan [-h]"),
    ],
)
def test_every_help_exits_0_and_names_its_program(argv, usage, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(usage), out[:300]
    assert "python -m" not in out.splitlines()[0]


def test_bench_script_help_names_the_command(capfd):
    assert main(["bench", "qk_clip", "--help"]) == 0  # runs benchmarks/qk_clip.py in a subprocess
    assert capfd.readouterr().out.startswith("usage: kimi-hf bench qk_clip [-h]")


def _runnable_benchmarks(folder: Path = ROOT / "benchmarks") -> set[str]:
    """The scripts of a folder with a `if __name__ == "__main__":` block (helpers such as common.py,
    memory_sampler.py and k3_shaped.py have none)."""
    import ast

    names = set()
    for path in folder.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            test = node.test if isinstance(node, ast.If) else None
            if isinstance(test, ast.Compare) and ast.unparse(test) in (
                '__name__ == "__main__"',
                "__name__ == '__main__'",
            ):
                names.add(path.stem)
    return names


def test_bench_lists_every_benchmark_script_and_only_those(capsys):
    """`kimi-hf bench --help` lists one table (kimi_hf.cli.BENCHMARKS): each name it lists is a benchmarks/NAME.py,
    and each benchmarks/*.py with a __main__ block is listed (the K3 ones included)."""
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    listing = out.split("NAME:\n", 1)[1].split("\n\n", 1)[0]
    listed = [line.split()[0] for line in listing.splitlines()]
    assert listed == list(BENCHMARKS)
    scripts = [name for name in listed if name != "claims"]  # claims: the folder benchmarks/claims/
    assert all((ROOT / "benchmarks" / f"{name}.py").is_file() for name in scripts), listed
    runnable = _runnable_benchmarks()
    assert {"k3", "k3_lora_memory", "k3_export", "k3_rank_load", "k3_context_memory", "kda_cuda"} <= runnable
    assert set(scripts) == runnable, set(scripts) ^ runnable
    assert main(["bench", "claims", "--help"]) == 0
    listing = capsys.readouterr().out.split("CLAIM:\n", 1)[1].split("\n\n", 1)[0]
    claims = [line.split()[0] for line in listing.splitlines()]
    assert claims == list(CLAIMS) == ["parl", "recall", "hybrid-ratio", "long-context"]  # the issue's fixed names
    runnable = {name.replace("_", "-") for name in _runnable_benchmarks(ROOT / "benchmarks" / "claims")}
    assert set(claims) == runnable, set(claims) ^ runnable


def test_quickstart_help_shows_defaults_and_descriptions(capsys):
    p = quickstart_parser()
    assert all(action.help for action in p._actions), [a.dest for a in p._actions if not a.help]
    assert main(["quickstart", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 500)", "(default: small)", "(default: outputs/quickstart)", "(default: 0.005)"):
        assert default in out


def test_usage_errors_exit_2_on_one_line(capsys):
    for argv, prog, message in (
        ([], "kimi-hf", "the following arguments are required: COMMAND"),
        (["fly"], "kimi-hf", "invalid choice: 'fly'"),
        (["-x"], "kimi-hf", "unrecognized arguments: -x"),
        (["convert"], "kimi-hf convert", "the following arguments are required: CONVERTER"),
        (["convert", "nothing"], "kimi-hf convert", "invalid choice: 'nothing'"),
        (["bench"], "kimi-hf bench", "the following arguments are required: NAME"),
        (["quickstart", "--steps", "many"], "kimi-hf quickstart", "argument --steps: invalid int value: 'many'"),
    ):
        assert main(argv) == 2, argv
        assert message in one_line_error(capsys.readouterr().err, f"{prog}: error: "), argv


def test_bad_max_shard_size_is_a_one_line_error_naming_the_option(tmp_path):
    r = shell(str(SCRIPT), "convert", "kimi-linear", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "5XB")
    assert r.returncode == 2
    line = one_line_error(r.stderr, "kimi-hf convert kimi-linear: error: ")
    assert "--max-shard-size" in line and "'5XB'" in line
    assert not (tmp_path / "out").exists()


def test_runtime_errors_are_one_line_exit_1(tmp_path, capsys, monkeypatch):
    assert main(["convert", "kimi-linear", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "missing" in one_line_error(capsys.readouterr().err)
    # the console script, through a real failing command
    r = shell(str(SCRIPT), "serve", "does/not/exist")
    assert r.returncode == 1
    assert one_line_error(r.stderr).startswith("kimi-hf: error: model directory 'does/not/exist' does not exist")
    monkeypatch.setenv("KIMI_HF_TRACEBACK", "1")  # the escape hatch: the exception itself
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main(["serve", "does/not/exist"])


@pytest.mark.parametrize(
    "blocker, kind",
    [
        ("model", "file"),
        ("trainer", "file"),
        ("loss.png", "dir"),
        ("question.png", "dir"),
        ("summary.json", "dir"),
        (".", "file"),
    ],
)
def test_quickstart_checks_every_output_path_before_any_work(tmp_path, blocker, kind):
    out = tmp_path / "qs"
    if blocker == ".":  # OUT itself is a file
        out.write_text("x")
        blocked = out
    else:
        out.mkdir()
        blocked = out / blocker
        blocked.write_text("x") if kind == "file" else blocked.mkdir()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    r = shell(
        str(SCRIPT),
        "quickstart",
        "--size",
        "tiny",
        "--steps",
        "1",
        "--batch-size",
        "2",
        "--text-examples",
        "2",
        "--image-examples",
        "2",
        "--eval-images",
        "1",
        "--out",
        str(out),
        "--no-progress",
        timeout=120,
    )
    assert r.returncode == 1 and r.stdout == ""  # not even step [1/6]
    line = one_line_error(r.stderr)
    assert repr(str(blocked)) in line and ("not a directory" if kind == "file" else "not a file") in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created


def test_quickstart_out_under_a_file_creates_nothing(tmp_path):
    from kimi_hf.quickstart import check_outputs

    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        check_outputs(str(tmp_path / "file" / "qs"))
    check_outputs(str(tmp_path / "new" / "deeper"))  # creatable: fine, and still not created
    assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.parametrize("arch", ["k3", "kimi-linear"])
def test_quickstart_end_to_end_from_the_command_line(tmp_path, arch):
    out = tmp_path / "qs"
    r = shell(
        str(SCRIPT),
        "quickstart",
        "--arch",
        arch,
        "--size",
        "tiny",
        "--steps",
        "3",
        "--batch-size",
        "4",
        "--text-examples",
        "16",
        "--image-examples",
        "16",
        "--eval-images",
        "4",
        "--out",
        str(out),
        "--no-progress",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for step in ("[1/6]", "[4/6]", "[6/6]", "model + processor:", "loss plot:"):
        assert step in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reload_max_logit_diff"] < 1e-4 and summary["steps"] == 3 and summary["device"] == "cpu"
    # the accuracy is a share of the 4 held-out scenes (seed 0 + 10_000), the mean of the per-count shares
    # weighted by the scenes of each count, and printed as written to the summary
    counts = Counter(ex["answer"] for ex in counting_examples(4, seed=10_000, size=84))
    accuracy, per_count = summary["held_out_counting_accuracy"], summary["held_out_per_count"]
    assert per_count.keys() == counts.keys() and summary["chance"] == 1 / len(counts)
    assert all((per_count[c] * n).is_integer() for c, n in counts.items()), per_count
    assert accuracy == pytest.approx(sum(per_count[c] * n for c, n in counts.items()) / 4)
    assert f"held-out counting accuracy {accuracy:.2f} on 4 new scenes (chance {summary['chance']:.2f};" in r.stdout
    question = f"How many circles are there? ({out / 'question.png'}, 3 circles + 1 square)"
    assert f"{question}: model answers {summary['image_answer']!r}\n" in r.stdout
    assert Image.open(out / "loss.png").size == (640, 400)
    assert {"config.json", "model.safetensors", "processor_config.json", "tokenizer.json", "kda.py"} <= set(
        os.listdir(out / "model")
    )
    assert summary["arch"] == arch
    config = json.loads((out / "model" / "config.json").read_text())
    eos = json.loads((out / "model" / "generation_config.json").read_text())["eos_token_id"]
    tokenizer = json.loads((out / "model" / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    with safe_open(out / "model" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    if arch == "k3":  # the official K3 layout, K3's chat format, stopping at <|end_of_msg|>
        assert config["model_type"] == "kimi_k3" and config["text_config"]["model_type"] == "kimi_linear"
        assert "language_model.lm_head.weight" in names and "mm_projector.proj.0.weight" in names
        # released with MXFP4 routed experts, which load resident
        assert any(".block_sparse_moe.experts.0.w1.weight_packed" in n for n in names)
        assert not any(n.endswith(".experts.0.w1.weight") for n in names)
        assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
        assert "experts rounded to MXFP4" in r.stdout
        # the saved template's default is the training format: no thinking-effort preamble
        processor = AutoProcessor.from_pretrained(out / "model")
        hello = processor.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
        assert hello == summary["chat_transcript"]["prompt"].split("<|kimi_image_placeholder|>")[0] + "Hello" + (
            '<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
        )
        assert eos == [ids["<|end_of_msg|>"], ids["[EOS]"]]
        assert summary["chat_transcript"]["prompt"].startswith('<|open|>message role="user"<|sep|>')
        assert "<|kimi_image_placeholder|>" in summary["chat_transcript"]["prompt"]
    else:
        assert config["model_type"] == "kimi_hybrid" and eos == [ids["[EOS]"], ids["<|im_end|>"]]
        assert summary["chat_transcript"]["prompt"].startswith("<|im_user|>")


def test_run_returns_the_result_and_raises():
    with pytest.raises(SystemExit) as e:
        run(["convert", "--help"])
    assert e.value.code == 0
    with pytest.raises(FileNotFoundError):
        run(["serve", "does/not/exist"])


def test_quickstart_rejects_bad_arguments():
    from kimi_hf.quickstart import run_quickstart

    with pytest.raises(ValueError, match="steps"):
        run_quickstart(steps=0)
    with pytest.raises(ValueError, match="batch_size"):
        run_quickstart(batch_size=16, text_examples_n=2, image_examples_n=2)
    with pytest.raises(ValueError, match="size"):
        run_quickstart(size="huge", steps=1, text_examples_n=1, image_examples_n=1, eval_images=1)
