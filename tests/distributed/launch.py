"""Launching the distributed workers of the tests: a free port on 127.0.0.1 and torchrun over gloo ranks (CPU)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, args: list[str], nproc: int) -> str:
    """Runs `script args` on `nproc` local ranks (one thread each); returns stdout, asserting a zero exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(free_port()), str(script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


def clean_env(**extra: str) -> dict:
    """This process's environment without a launcher's variables (a test run under torchrun or accelerate must not
    pass its rank to the jobs it starts), the checkout importable, one thread a rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "TORCHELASTIC_"))}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def run(cmd: list[str], timeout: int = 600, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs a command (a launcher and its ranks) in its own process group, killed whole on a timeout."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(**(extra_env or {})),
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out: {cmd}\n{out[-2000:]}{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_nodes(
    args: list[str], nodes: int = 2, nproc: int = 2, timeout: int = 600
) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes N ... args` once a "node", all on 127.0.0.1, meeting at one c10d rendezvous (what a cluster
    job runs, one command a node); every node's result, each asserted to exit 0. args: a script or `-m module`, and
    its flags."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc)]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"test{port}", *args]
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
            cwd=ROOT,
            start_new_session=True,
        )
        for _ in range(nodes)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append(subprocess.CompletedProcess(cmd, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for o in outs:
        assert o.returncode == 0, o.stderr[-4000:]
    return outs
