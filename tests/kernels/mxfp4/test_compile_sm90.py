"""The MXFP4 grouped-matmul kernel (forward and input gradient) builds for sm_90 through Triton's whole pipeline and
the bundled ptxas, without a GPU, in every configuration its autotuner can run (each config at each tile height BM
the wrapper picks): the interpreter tests check the numerics (in one small config), not what only the compiler
rejects."""

import os
import subprocess
import sys

from kimi_hf_kernels.mxfp4 import compile_check, grouped_matmul


def test_grouped_matmul_compiles_for_sm90_in_every_autotuner_config():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "kimi_hf_kernels.mxfp4.compile_check", "--dtype", "bf16", "fp32"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| kernel")).split("|")[1:-1]]
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines if line.startswith("| ")]
    rows = [dict(zip(header, r)) for r in cells if r != header]
    built = [(r["kernel"], r["dtype"], int(r["warps"]), r[compile_check.TILE_COLUMN]) for r in rows]
    # this process runs under TRITON_INTERPRET (one interpreter config): the GPU list is the module's GPU_CONFIGS,
    # which the check read from the autotuner in its own process
    expected = [
        (name, dtype, config.num_warps, compile_check.tile(config, BM))
        for dtype in ("bf16", "fp32")
        for name, _ in compile_check.DIRECTIONS
        for config in grouped_matmul.GPU_CONFIGS
        for BM in grouped_matmul.BLOCK_ROWS
    ]
    assert len(built) == len(set(built)) == len(expected)  # each build once
    assert sorted(built) == sorted(expected), out.stdout
    bf16_stack = [int(r["stack bytes / thread (spills)"]) for r in rows if r["dtype"] == "bf16"]
    assert bf16_stack and all(s == 0 for s in bf16_stack), out.stdout  # the bf16 builds spill nothing, at every BM
    print(out.stdout)
