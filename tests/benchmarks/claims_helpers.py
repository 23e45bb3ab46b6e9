"""What the claim scripts' tests share (benchmarks/claims/*.py): running a script as a user does, and reading the
seeds cells of `report.cell` back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
CLAIMS = ROOT / "benchmarks" / "claims"
NUMBER = r"[-+]?\d+(?:\.\d+)?"


def run_claim(script: Path, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python benchmarks/claims/SCRIPT ARGS...` from the checkout (on PYTHONPATH), one thread."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def seeds_mean(cell: str, suffix: str = "") -> float | None:
    """A seeds cell (`report.cell`): `x` (one seed) or `mean ± std [min, max]`, followed by `suffix`; `-` (no
    value). Its mean, None for `-`."""
    if cell == "-":
        return None
    m = re.fullmatch(rf"({NUMBER})(?: ± ({NUMBER}) \[({NUMBER}), ({NUMBER})\])?{re.escape(suffix)}", cell)
    assert m, cell
    return float(m.group(1))
