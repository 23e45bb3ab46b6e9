"""Ahead-of-time compile of the MXFP4 grouped-matmul kernel (forward and input gradient) for a CUDA target,
without a GPU or a driver, as `kimi_hf_kernels.kda.compile_check` does for the KDA kernels:

    python -m kimi_hf_kernels.mxfp4.compile_check [--arch 90] [--dtype bf16 fp32] [--warps 4 8]

Prints registers, spills and shared memory per build. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import os

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from ..kda.compile_check import resource_usage
from .grouped_matmul import mxfp4_grouped_matmul_kernel


# the directions built: (name, TRANSPOSE)
DIRECTIONS = (("forward", False), ("input_grad", True))


def compile_kernel(
    transpose: bool, dtype: str, arch: int, num_warps: int = 8, BM: int = 64, BN: int = 64, BK: int = 32
):
    fn = mxfp4_grouped_matmul_kernel.fn  # the autotuner wraps the JITFunction
    sig = {
        "a": f"*{dtype}",
        "packed": "*u8",
        "scale": "*u8",
        "y": f"*{dtype}",
        "tile_expert": "*i32",
        "tile_row": "*i32",
        "tile_end": "*i32",
        "OUT": "i32",
        "IN": "i32",
    }
    consts = {"BM": BM, "BN": BN, "BK": BK, "TRANSPOSE": transpose, "FP32": dtype == "fp32"}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton_compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": 2})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    p.add_argument("--warps", type=int, nargs="+", default=[8])
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=["fp32", "bf16", "fp16"])
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: this compiles for the GPU")
    print(f"# MXFP4 grouped matmul compiled for sm_{args.arch}")
    print("| kernel | dtype | warps | registers / thread | stack bytes / thread (spills) | shared bytes |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtype:
        for name, transpose in DIRECTIONS:
            for warps in args.warps:
                usage = resource_usage(compile_kernel(transpose, dtype, args.arch, warps).asm["cubin"])
                print(
                    f"| {name} | {dtype} | {warps} | {usage['registers']} | {usage['stack']} | {usage['shared']} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
