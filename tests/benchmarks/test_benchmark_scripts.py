"""The benchmark scripts run end to end at toy sizes (their numbers are not checked: machines are noisy)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

CASES = {
    "kda.py": ["--T", "64", "128", "--repeats", "1", "--no-memory"],
    "kda_cuda.py": ["--smoke"],  # the CUDA section's script, on the interpreter (conftest sets TRITON_INTERPRET=1)
    "model.py": ["--T", "64", "--repeats", "1", "--decode-tokens", "2"],
    "optimizer_step.py": ["--hidden", "64", "--repeats", "1"],
    "muon_vs_adamw.py": ["--steps", "4", "--eval-every", "2", "--muon-steps", "2", "--hidden", "32", "--out", "{tmp}/m.png"],
    "qk_clip.py": ["--steps", "3", "--hidden", "32", "--out", "{tmp}/q.png"],
    "attn_res.py": ["--layers", "2", "--hidden", "32", "--steps", "3", "--eval-every", "2", "--batch", "2", "--seq", "32",
                    "--block-size", "2", "--timing-rounds", "1", "--out", "{tmp}/ar"],
    "conversion.py": ["--hidden", "128", "--layers", "2", "--experts", "4", "--vocab", "512", "--shard", "1MB"],
    "vision.py": ["--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "64", "--text-hidden", "32",
                  "--size", "56", "--images", "1", "--repeats", "1"],
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_script_runs(script, tmp_path):
    args = [a.format(tmp=tmp_path) for a in CASES[script]]
    out = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "|" in out.stdout  # printed its table
