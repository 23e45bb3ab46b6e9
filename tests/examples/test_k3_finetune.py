"""examples/k3_finetune.py, the fixed interface, on a tiny Kimi K3 in the released layout (MXFP4 experts): the same
losses on every layout it runs (one process; PP 2 x FSDP2 2; FSDP2 x EP; PP 2 x FSDP2 x EP; CP; PP 2 with AdamW),
launched by torchrun on one and on two "nodes" and by accelerate; a sharded checkpoint resumes bit-identically and onto another layout; bad
layouts are one-line errors naming the size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.launch import ROOT, free_port, run, run_nodes


SCRIPT = ROOT / "examples" / "k3_finetune.py"
COMMON = ["--steps", "3", "--data", "random", "--seq-len", "32"]
REL = 1e-5  # the bound: the same seed and data give the same losses in every layout


def losses(out: subprocess.CompletedProcess) -> dict[int, float]:
    """The JSON lines of rank 0 (stdout holds nothing else)."""
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-5000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(set(r) == {"step", "loss"} for r in rows), out.stdout
    return {r["step"]: r["loss"] for r in rows}


def one_process(folder, *args) -> dict[int, float]:
    return losses(run([sys.executable, str(SCRIPT), "--model", str(folder), *COMMON, *args]))


def torchrun(folder, nproc: int, *args) -> dict[int, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), str(SCRIPT), "--model", str(folder), *COMMON, *args]
    return losses(run(cmd))


def assert_same(a: dict, b: dict, rel: float = REL) -> None:
    assert a.keys() == b.keys()
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=rel, abs=0), (step, a, b)


@pytest.fixture(scope="module")
def k3_folder(tmp_path_factory) -> Path:
    from tests.models.kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint

    folder = tmp_path_factory.mktemp("k3_release")
    write_k3_checkpoint(folder, tiny_k3_config(), seed=0, mxfp4=True, shards=3, dtype="float32")
    return folder


@pytest.fixture(scope="module")
def reference(k3_folder) -> dict:
    """One process: LoRA over the resident MXFP4 experts (MuonClip), and full fine-tuning (dense experts) with
    MuonClip and with AdamW."""
    return {
        "lora": one_process(k3_folder, "--lora"),
        "full": one_process(k3_folder, "--full"),
        "full_adamw": one_process(k3_folder, "--full", "--optimizer", "adamw"),
    }


def test_fsdp2_x_ep_matches_one_process(k3_folder, reference):
    assert reference["full"][2] != reference["full"][0]  # the steps train
    assert_same(reference["full"], torchrun(k3_folder, 2, "--full", "--ep", "2", "--fsdp", "2"))


def test_pp2_x_tp2_x_ep2_matches_one_process(k3_folder, reference):
    """TP x EP x PP on 4 ranks, LoRA over the resident MXFP4 experts: 2 stages, each tensor-parallel over its 2 ranks
    with the experts whole over the same ranks (PEFT's tensor-parallel adapters). LoRA's losses under TP are one
    process's to 1e-7 (full fine-tuning's are not to 1e-5: TP reorders sums, ~4e-5 in fp32 gradients, which MuonClip's
    orthogonalisation amplifies; docs/parallelism.md)."""
    assert_same(reference["lora"], torchrun(k3_folder, 4, "--lora", "--pp", "2", "--tp", "2", "--ep", "2"))


def test_lora_under_tp2_x_ep2_with_two_replicas_matches_one_process(k3_folder, reference):
    """LoRA on TP 2 x EP 2 with 2 replicas (4 ranks): PEFT's tensor-parallel adapters (DTensors over "tp") are drawn
    slice by slice from one process's values and their gradients averaged over the replicas of each tp coordinate
    (without that average step 1 differs by 5e-5 and step 2 by 1e-3 relative)."""
    assert_same(reference["lora"], torchrun(k3_folder, 4, "--lora", "--tp", "2", "--ep", "2"))


@pytest.mark.parametrize(
    "mode, nproc, layout",
    [
        # (CP 2 alone, LoRA and full: tests/finetune/test_cli.py and the layouts below)
        ("full", 4, ["--ep", "2", "--fsdp", "2", "--cp", "2"]),  # CP 2 x FSDP2 x EP 2
        ("full", 4, ["--tp", "2", "--ep", "2", "--cp", "2"]),  # TP 2 x EP 2 x CP 2
        ("full", 4, ["--pp", "2", "--ep", "2", "--fsdp", "2", "--cp", "2"]),  # PP 2 x FSDP2 2 x EP 2 x CP 2
    ],
    ids=["cp2_fsdp2_ep2", "tp2_ep2_cp2", "pp2_fsdp2_ep2_cp2"],
)
def test_context_parallel_matches_one_process(k3_folder, reference, mode, nproc, layout):
    """Each sequence split over the --cp ranks (KDA's state maps composed, the short convolutions' left context and
    MLA's latent exchanged): the losses of one process, the whole sequences at once. The last layout is the 4-D one:
    2 pipeline stages, each loaded with its experts over its 2 data ranks, which also split each sequence."""
    assert_same(reference[mode], torchrun(k3_folder, nproc, f"--{mode}", *layout))


def test_two_nodes_then_resume_on_another_layout(k3_folder, reference, tmp_path):
    """Two torchrun "nodes" of 2 processes each meeting at a c10d rendezvous on 127.0.0.1 (what a 2-node cluster job
    runs, one command a node) train LoRA on `--pp 2 --ep 2` (fsdp filled in: PP 2 x FSDP2 2 x EP 2) (a stage's resident MXFP4 experts split over its
    2 data ranks) for 2 of the 3 steps and save a sharded checkpoint; FSDP2 x EP 2 on 2 ranks resumes it (DCP
    reshards the adapters and MuonClip's momentum) for the last step: the losses are one process's."""
    ck = tmp_path / "ck"
    # --fsdp left out: the 2 data ranks pp 2 leaves of 4 (ParallelDims), as torchtitan's -1
    flags = [*COMMON, "--lora", "--pp", "2", "--ep", "2", "--steps", "2", "--checkpoint-dir", str(ck)]
    outs = run_nodes([str(SCRIPT), "--model", str(k3_folder), *flags])
    printed = [o for o in outs if o.stdout.strip()]
    assert len(printed) == 1, [o.stdout for o in outs]  # global rank 0 is on one of the nodes
    first = losses(printed[0])
    assert list(first) == [0, 1]
    assert sorted(os.listdir(ck)) == ["step-2"]
    rest = torchrun(k3_folder, 2, "--lora", "--ep", "2", "--fsdp", "2", "--checkpoint-dir", str(ck), "--resume")
    assert list(rest) == [2]
    assert_same(reference["lora"], {**first, **rest})


def test_accelerate_launch_matches_one_process(k3_folder, reference, tmp_path):
    """The shipped accelerate config (4 processes), here with 2: PP 2, full fine-tuning with AdamW, activation
    checkpointing (the same losses: the recomputed layers are the same computation)."""
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.accelerate_cli",
        "launch",
        "--main_process_port",
        str(free_port()),
        "--config_file",
        str(ROOT / "examples" / "accelerate" / "cpu_k3_finetune.yaml"),
        "--num_processes",
        "2",
        str(SCRIPT),
        "--model",
        str(k3_folder),
        *COMMON,
        "--full",
        "--pp",
        "2",
        "--optimizer",
        "adamw",
        "--gradient-checkpointing",
    ]
    assert_same(reference["full_adamw"], losses(run(cmd, extra_env={"HF_HOME": str(tmp_path / "hf")})))


def test_resume_is_bit_identical(k3_folder, reference, tmp_path):
    """Stop after 2 of 3 steps and resume on the same layout: the uninterrupted run's losses, bit for bit; the
    checkpoint's files are ordinary 0644 files under step-2 (written as .step-2.tmp, then renamed)."""
    ck = tmp_path / "one"
    first = one_process(k3_folder, "--full", "--steps", "2", "--checkpoint-dir", str(ck))
    assert sorted(os.listdir(ck)) == ["step-2"]
    assert all(
        (os.stat(os.path.join(root, f)).st_mode & 0o777) == 0o644 for root, _, files in os.walk(ck) for f in files
    )
    rest = one_process(k3_folder, "--full", "--checkpoint-dir", str(ck), "--resume")
    assert {**first, **rest} == reference["full"]  # exactly


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ep", "3"], "--ep 3 does not divide num_experts"),
        (["--pp", "9"], "--pp 9 leaves a pipeline stage without layers"),
        (["--fsdp", "2"], "--fsdp 2 does not divide the 1 data ranks"),
        (["--cp", "2"], "--cp 2 does not divide the 1 data ranks"),
        (["--cp", "2", "--seq-len", "33"], "--seq-len 33 is not divisible by --cp 2"),
        (
            ["--cp", "16"],
            "--seq-len 32 over --cp 16 holds 2 tokens, fewer than the short convolution's left context (3)",
        ),
        (["--resume", "--checkpoint-dir", "{tmp}/none"], "no checkpoint (step-N folder) to resume from"),
        (["--data", "stdlib"], "--data stdlib needs a tokenizer"),
    ],
)
def test_bad_input_is_one_line(k3_folder, tmp_path, args, message, capsys):
    """Checked before any model is built (in this process: the script's main, as `python` runs it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k3_finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--model", str(k3_folder), *COMMON, *args])
    assert exit_info.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("k3_finetune: error: "), out.err
    assert message in out.err


@pytest.mark.parametrize(
    "world, args, fix",
    [
        (4, ["--lora", "--pp", "2", "--ep", "2", "--fsdp", "1"], "add --fsdp 2"),
        (2, ["--tp", "2"], "add --ep 2"),  # the MXFP4 experts' 96 inputs would split into 48, not 32-blocks
        (1, ["--fsdp", "2"], "drop --fsdp 2"),
        (2, ["--micro-batches", "3"], "use --micro-batches 4"),
        (4, ["--pp", "2", "--fsdp", "2", "--micro-batches", "2"], "use --micro-batches 4 (or --schedule gpipe)"),
        (1, ["--cp", "2", "--seq-len", "33"], "use --seq-len 34"),
    ],
)
def test_refused_layouts_name_the_flag_that_fixes_them(k3_folder, monkeypatch, capsys, world, args, fix):
    """Checked on rank 0 of a `world`-rank job before its process group starts (so in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k3_finetune", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--model", str(k3_folder), *COMMON, *args])
    assert exit_info.value.code == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("k3_finetune: error: "), out.err
    assert fix in out.err


def test_a_refused_layout_is_printed_once_by_rank_0(k3_folder):
    """--pp 2 --ep 2 --fsdp 1 on 4 ranks: one line naming the fix (not one a rank), every rank exiting with status 2."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port())]
    cmd += [str(SCRIPT), "--model", str(k3_folder), *COMMON, "--lora", "--pp", "2", "--ep", "2", "--fsdp", "1"]
    out = run(cmd)
    assert out.returncode != 0 and out.stdout == ""
    errors = [line for line in out.stderr.splitlines() if "k3_finetune: error:" in line]
    assert len(errors) == 1 and errors[0].startswith("k3_finetune: error: --ep 2") and "add --fsdp 2" in errors[0]
    assert "exitcode: 2" in out.stderr  # torchrun's report of rank 0's status


@pytest.mark.parametrize("problem", ["missing", "another architecture", "truncated"])
def test_a_bad_model_folder_is_one_line(k3_folder, tmp_path, problem):
    """The folder check (kimi_hf.model_folder) runs before anything loads: one line naming the problem, status 2."""
    import shutil

    folder = tmp_path / "model"
    if problem == "another architecture":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32}))
        expected = "model_type 'llama'"
    elif problem == "truncated":
        folder.mkdir()
        shutil.copyfile(k3_folder / "config.json", folder / "config.json")
        data = (k3_folder / "model-00001-of-00003.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) - 100])  # an interrupted download
        expected = f"{folder / 'model.safetensors'}: truncated"
    else:
        expected = "--model"
    out = run([sys.executable, str(SCRIPT), "--model", str(folder), *COMMON], timeout=300)
    assert out.returncode == 2 and out.stdout == "", out.stderr[-3000:]
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("k3_finetune: error: "), out.stderr
    assert expected in out.stderr and str(folder) in out.stderr
