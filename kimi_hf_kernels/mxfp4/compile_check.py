"""Ahead-of-time compile of the MXFP4 grouped-matmul kernel (forward and input gradient) for a CUDA target,
without a GPU or a driver, as `kimi_hf_kernels.kda.compile_check` does for the KDA kernels:

    python -m kimi_hf_kernels.mxfp4.compile_check [--arch 90] [--dtype bf16 fp32] [--warps 4 8]

Builds every configuration the autotuner can run: each of its configs (BN, BK, warps, stages: read from the
autotuned kernel, `grouped_matmul.CONFIGS`) at each tile height BM the wrapper picks (`grouped_matmul.BLOCK_ROWS`),
in both directions; --warps keeps only the configs with those warps. Prints registers, spills and shared memory per
build. Must run without TRITON_INTERPRET (under it the autotuner holds the interpreter's single config).
"""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from ..kda.compile_check import parse, parser, print_header, print_row
from .grouped_matmul import BLOCK_ROWS, mxfp4_grouped_matmul_kernel


# the directions built: (name, TRANSPOSE)
DIRECTIONS = (("forward", False), ("input_grad", True))
TILE_COLUMN = "tile BM x BN x BK, stages"


def autotuner_configs() -> list:
    """The triton.Configs the autotuner chooses among (in this process: no TRITON_INTERPRET, the GPU list)."""
    return list(mxfp4_grouped_matmul_kernel.configs)


def tile(config, BM: int) -> str:
    """A build's tile as its table cell, e.g. '64 x 128 x 32, 2'."""
    return f"{BM} x {config.kwargs['BN']} x {config.kwargs['BK']}, {config.num_stages}"


def compile_kernel(transpose: bool, dtype: str, arch: int, config, BM: int):
    """One build: `config` (a triton.Config of the autotuner: BN, BK, warps, stages) at tile height BM."""
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
    consts = {"BM": BM, **config.kwargs, "TRANSPOSE": transpose, "FP32": dtype == "fp32"}
    sig.update(dict.fromkeys(consts, "constexpr"))
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton_compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def main(argv=None):
    args = parse(parser(__doc__, None, ["bf16", "fp32"]), argv)
    configs = [c for c in autotuner_configs() if args.warps is None or c.num_warps in args.warps]
    print_header(f"# MXFP4 grouped matmul compiled for sm_{args.arch}: every autotuner config", (TILE_COLUMN,))
    for dtype in args.dtype:
        for name, transpose in DIRECTIONS:
            for config in configs:
                for BM in BLOCK_ROWS:
                    compiled = compile_kernel(transpose, dtype, args.arch, config, BM)
                    print_row(name, dtype, config.num_warps, compiled, (tile(config, BM),))


if __name__ == "__main__":
    main()
