"""`accelerate launch` with the shipped configs (examples/accelerate/) on a machine without GPUs: 2 gloo processes
that really run, train as one process does (DDP; accelerate's own FSDP2 preparation), and fail loudly where
accelerate would silently run something else.

What accelerate 1.x does on CPU (accelerate/commands/launch.py, state.py):
- `accelerate launch --num_processes 2 script.py` (or with `--cpu`, or a `distributed_type: MULTI_CPU` config,
  accelerate's mpirun / oneCCL path, without an mpirun hostfile): the simple launcher, ONE process.
  `--multi_gpu --cpu` is refused ("only one of").
- `distributed_type: MULTI_GPU` (examples/accelerate/cpu_ddp.yaml) or `FSDP` configs, `--multi_gpu`: torchrun starts
  the processes; they join over gloo only with `Accelerator(cpu=True)` (or ACCELERATE_USE_CPU=1); without it each is
  DistributedType.NO and trains alone (the config's `use_cpu` does not reach them).
- An FSDP config on CPU: AcceleratorState selects FSDP only for accelerator devices, so the gloo run is MULTI_CPU and
  `prepare` returns DDP, silently. accelerate_probe.check_setup (which accelerate_worker.py runs) refuses both.
- With FSDP selected by the script itself (accelerate_worker.py --force-fsdp2-on-cpu), accelerate's FSDP2 preparation
  runs on gloo and trains our models as one process does.
"""

import functools
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "accelerate"
WORKER = ROOT / "tests" / "optim" / "accelerate_worker.py"
PROBE = ROOT / "tests" / "optim" / "accelerate_probe.py"
ARCHS = ("hybrid", "k3", "k3-images")
# the ranks' gradient sums round in another order than one process's backward (fp32, ~1e-8), and Newton-Schulz
# amplifies that (tests/optim/test_distributed.py): observed 1.3e-6 for the hybrid model (a router weight), 1.2e-5
# for K3 (its embedding) after 3 steps, DDP and FSDP2 alike. "k3-images" averages the two ranks' losses in one
# process too, and matched bit for bit.
# K3: its embeddings (token and patch) feed depth block 0 of Attention Residuals, whose gradient sums every later
# layer's share in an order that differs between FSDP2 and one process (each later layer reaches the blocks directly,
# not through every layer's FSDP2 input view), then AdamW / Newton-Schulz amplify rounding: 8.9e-5 and 9.5e-5 measured
# on the token and patch embeddings, every other parameter within 2e-5
ATOL = {"hybrid": 5e-6, "k3": 1.5e-4, "k3-images": 1.5e-4}
LAUNCH_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(args, tmp_path, extra_env=None) -> subprocess.CompletedProcess:
    """`accelerate launch --main_process_port <free> ARGS`, with no accelerate settings from this environment (nor a
    default config: HF_HOME is a fresh folder)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACCELERATE_", "FSDP_", "TORCHELASTIC_")) and k not in LAUNCH_ENV
    }
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), **(extra_env or {}))
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch"]
    cmd += ["--main_process_port", str(free_port()), *map(str, args)]
    # a session of its own: on a timeout (a collective that never completes) the ranks go down with the launcher
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"accelerate launch timed out: {cmd}\n{stdout[-3000:]}{stderr[-5000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def probes(out: subprocess.CompletedProcess) -> list[dict]:
    return sorted(
        (json.loads(line[len("PROBE ") :]) for line in out.stdout.splitlines() if line.startswith("PROBE ")),
        key=lambda p: p["process_index"],
    )


@pytest.mark.parametrize(
    "case", ["num_processes_alone", "cpu_ddp_without_cpu_true", "cpu_ddp_accelerate_use_cpu", "cpu_fsdp2_becomes_ddp"]
)
def test_what_accelerate_starts_on_cpu(tmp_path, case):
    """accelerate's behaviour on CPU, which the docs and the configs' comments describe (not ours): pinned here so
    that a change in accelerate shows up."""
    if case == "num_processes_alone":  # the simple launcher: one process, and nothing to tell it from a 1-process run
        out = accelerate_launch(["--num_processes", "2", PROBE, "--cpu", "--check"], tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        (p,) = probes(out)
        assert (p["WORLD_SIZE"], p["distributed_type"], p["num_processes"]) == (None, "NO", 1)
    elif case == "cpu_ddp_without_cpu_true":  # torchrun starts 2, each trains alone: check_setup refuses
        out = accelerate_launch(["--config_file", CONFIGS / "cpu_ddp.yaml", PROBE, "--check"], tmp_path)
        got = probes(out)
        assert len(got) == 2 and len({p["pid"] for p in got}) == 2, out.stdout + out.stderr[-3000:]
        assert all((p["WORLD_SIZE"], p["distributed_type"], p["num_processes"]) == ("2", "NO", 1) for p in got)
        assert out.returncode != 0
        assert "2 processes were launched (WORLD_SIZE) but accelerate runs 1" in out.stderr
    elif case == "cpu_ddp_accelerate_use_cpu":  # a script without cpu=True joins with ACCELERATE_USE_CPU=1
        out = accelerate_launch(
            ["--config_file", CONFIGS / "cpu_ddp.yaml", PROBE, "--check"], tmp_path, {"ACCELERATE_USE_CPU": "1"}
        )
        assert out.returncode == 0, out.stderr[-3000:]
        got = probes(out)
        assert [p["process_index"] for p in got] == [0, 1] and len({p["pid"] for p in got}) == 2
        for p in got:
            assert (p["distributed_type"], p["backend"], p["num_processes"]) == ("MULTI_CPU", "gloo", 2)
            assert p["wrapper"] == "DistributedDataParallel"
    else:  # FSDP asked for, MULTI_CPU + DDP prepared: check_setup refuses
        out = accelerate_launch(["--config_file", CONFIGS / "cpu_fsdp2.yaml", PROBE, "--cpu", "--check"], tmp_path)
        got = probes(out)
        assert [p["process_index"] for p in got] == [0, 1], out.stdout + out.stderr[-3000:]
        for p in got:
            assert (p["ACCELERATE_USE_FSDP"], p["distributed_type"], p["backend"]) == ("true", "MULTI_CPU", "gloo")
            assert p["wrapper"] == "DistributedDataParallel"
        assert out.returncode != 0
        assert "the accelerate config asks for FSDP but accelerate prepared DistributedType.MULTI_CPU" in out.stderr


@functools.lru_cache(maxsize=None)
def reference(arch: str):
    """One process, on one thread as each launched process (OMP_NUM_THREADS=1): another thread count sums the
    matmuls in another order too (up to 5.7e-5 on K3's patch embedding after Newton-Schulz, on 2 threads)."""
    from tests.optim.accelerate_worker import reference as run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(arch)
    finally:
        torch.set_num_threads(threads)


def assert_trained_as_one_process(folder: Path, arch: str, distributed_type: str, wrapper: str) -> list[dict]:
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world_size"] for r in ranks} == {2}
    assert ranks[0]["pid"] != ranks[1]["pid"]  # two processes really ran
    assert {r["distributed_type"] for r in ranks} == {distributed_type}
    assert {r["wrapper"] for r in ranks} == {wrapper}
    params, biases, losses, clipped = reference(arch)
    assert clipped > 0 and all(r["clipped_heads"] == clipped for r in ranks)  # QK-Clip clipped the same heads
    for r in ranks:  # the loss of the global batch (the ranks' mean), step by step
        assert max(abs(a - b) for a, b in zip(r["losses"], losses)) < 1e-5, (r["losses"], losses)
    trained = load_file(folder / "model.safetensors")
    assert set(trained) == set(params) | set(biases)
    for name, p in params.items():
        assert torch.allclose(trained[name], p, atol=ATOL[arch]), (name, (trained[name] - p).abs().max())
    assert any(b.abs().sum() > 0 for b in biases.values())  # expert balancing moved the biases
    for name, b in biases.items():  # the ranks' expert loads summed: the single process's update
        assert torch.equal(trained[name], b), name
    return ranks


def test_cpu_ddp_config_trains_two_gloo_ranks_as_one_process(tmp_path):
    """examples/accelerate/cpu_ddp.yaml: 2 gloo processes, DDP; the tiny hybrid model, a tiny K3 on text, and the tiny
    K3 with an image in one rank's rows at two of the three steps (rank 0, then rank 1; none at the other)."""
    out = accelerate_launch(["--config_file", CONFIGS / "cpu_ddp.yaml", WORKER, tmp_path / "ddp", *ARCHS], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    for arch in ARCHS:
        assert_trained_as_one_process(tmp_path / "ddp" / arch, arch, "MULTI_CPU", "DistributedDataParallel")


def test_accelerate_fsdp2_preparation_on_gloo_trains_as_one_process(tmp_path):
    """examples/accelerate/cpu_fsdp2.yaml with FSDP selected by the worker (accelerate never does on CPU): accelerate's
    fsdp2_prepare_model shards one unit per KimiHybridDecoderLayer (the config's fsdp_transformer_layer_cls_to_wrap),
    the embedding, the head (with the final norm where accelerate finds it: the text model's), and the root; with
    transformers' gradient checkpointing. Every parameter a DTensor; the results those of one process, also when the
    ranks' vision towers run at different steps (the tower is in the root unit: every rank gathers it)."""
    args = ["--config_file", CONFIGS / "cpu_fsdp2.yaml", WORKER, tmp_path / "fsdp2", *ARCHS]
    out = accelerate_launch([*args, "--force-fsdp2-on-cpu", "--gradient-checkpointing"], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    layers = ["FSDPKimiHybridDecoderLayer"] * 4
    for arch in ARCHS:
        cls = "KimiHybridForCausalLM" if arch == "hybrid" else "KimiK3ForConditionalGeneration"
        ranks = assert_trained_as_one_process(tmp_path / "fsdp2" / arch, arch, "FSDP", "FSDP" + cls)
        tail = ["FSDPKimiHybridRMSNorm"] if arch == "hybrid" else []
        vocab, hidden = (97, 32) if arch == "hybrid" else (100, 64)
        for r in ranks:
            assert r["fsdp_units"] == sorted(["FSDPEmbedding", *layers, *tail, "FSDPLinear"])
            assert r["dtensor_params"] == r["params"]
        assert [r["lm_head_local_shape"] for r in ranks] == [[-(-vocab // 2), hidden], [vocab // 2, hidden]]
