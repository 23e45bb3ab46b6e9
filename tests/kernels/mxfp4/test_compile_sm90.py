"""The MXFP4 grouped-matmul kernel (forward and input gradient) builds for sm_90 through Triton's whole pipeline and
the bundled ptxas, without a GPU: the interpreter tests check the numerics, not what only the compiler rejects."""

import os
import subprocess
import sys


def test_grouped_matmul_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "kimi_hf_kernels.mxfp4.compile_check", "--dtype", "bf16", "fp32"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|")[1:4] for line in out.stdout.splitlines() if line.startswith("| ") and "kernel" not in line]
    built = {(name.strip(), dtype.strip()) for name, dtype, _ in rows}
    assert built == {(k, d) for k in ("forward", "input_grad") for d in ("bf16", "fp32")}
    bf16_stack = [int(line.split("|")[5]) for line in out.stdout.splitlines() if "| bf16 |" in line]
    assert bf16_stack and all(s == 0 for s in bf16_stack), out.stdout  # the bf16 builds spill nothing
    print(out.stdout)
