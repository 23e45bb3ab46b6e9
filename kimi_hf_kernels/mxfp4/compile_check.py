"""Ahead-of-time compile of the MXFP4 grouped-matmul kernel (forward and input gradient) for a CUDA target,
without a GPU or a driver, as `kimi_hf_kernels.kda.compile_check` does for the KDA kernels:

    python -m kimi_hf_kernels.mxfp4.compile_check [--arch 90] [--dtype bf16 fp32] [--warps 4 8]

Prints registers, spills and shared memory per build. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from ..kda.compile_check import parse, parser, print_header, print_row
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
    args = parse(parser(__doc__, [8], ["bf16", "fp32"]), argv)
    print_header(f"# MXFP4 grouped matmul compiled for sm_{args.arch}")
    for dtype in args.dtype:
        for name, transpose in DIRECTIONS:
            for warps in args.warps:
                print_row(name, dtype, warps, compile_kernel(transpose, dtype, args.arch, warps))


if __name__ == "__main__":
    main()
