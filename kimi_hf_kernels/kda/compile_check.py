"""Ahead-of-time compile of every KDA kernel for a CUDA target, without a GPU or a driver.

    python -m kimi_hf_kernels.kda.compile_check [--arch 90] [--D 128]

Builds each kernel through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
bundled ptxas) for fp32 and bf16 inputs at head dim D, and prints registers, spills and shared
memory per kernel (from cuobjdump). The interpreter tests check the numerics; this checks that the
same code builds for a real GPU and how heavy each kernel is. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import tempfile

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler import compile as triton_compile

from . import chunk_bwd, chunk_fwd, recurrent
from .common import INNER_BLOCK


# pointers holding inputs, outputs of the inputs' dtype and the stored dot operands
_INPUT_DTYPE = {"q", "k", "v", "g", "beta", "W", "U", "vnew", "hs", "o", "do", "dq", "dk", "dv", "dg", "dbeta"}
_INT = {"chunk_bos", "chunk_len", "seq_chunks", "cu_seqlens"}
_SCALARS = {"scale": "fp32", "lower_bound": "fp32", "T": "i32"}
# the kernels that apply the gate are also built with Kimi K3's safe gate (SAFE_GATE, a constexpr branch)
SAFE_GATE_KERNELS = ("gate_cumsum", "intra_bwd", "recurrent")
_SAFE_SUFFIX = "[safe_gate]"


def kernels():
    """Name -> kernel; "NAME[safe_gate]" is NAME built with SAFE_GATE on."""
    base = {
        "gate_cumsum": chunk_fwd.gate_cumsum_kernel,
        "scores": chunk_fwd.scores_kernel,
        "wy": chunk_fwd.wy_kernel,
        "state": chunk_fwd.state_kernel,
        "output": chunk_fwd.output_kernel,
        "state_bwd": chunk_bwd.state_bwd_kernel,
        "local_bwd": chunk_bwd.local_bwd_kernel,
        "wy_bwd": chunk_bwd.wy_bwd_kernel,
        "intra_bwd": chunk_bwd.intra_bwd_kernel,
        "recurrent": recurrent._recurrent_kda_fwd,
    }
    return {**base, **{name + _SAFE_SUFFIX: base[name] for name in SAFE_GATE_KERNELS}}


def constexprs(D: int, safe_gate: bool = False) -> dict:
    """One value per constexpr parameter name used by the kernels (every optional path on; the gate is
    Kimi-Linear's unless safe_gate)."""
    return dict(
        H=32,
        K=D,
        V=D,
        BT=64,
        BC=16,
        BK=D,
        BKB=INNER_BLOCK,
        BV=32,
        L2NORM=True,
        BETA_SIGMOID=True,
        GATE=True,
        SAFE_GATE=safe_gate,
        HAS_A=True,
        HAS_BIAS=True,
        INVERT=True,
        USE_H0=True,
        STORE_HT=True,
        USE_DHT=True,
        STORE_DH0=True,
        VARLEN=True,
    )


def compile_kernel(
    kernel, D: int, dtype: str, arch: int, num_warps: int = 4, num_stages: int = 2, safe_gate: bool = False
):
    fn = getattr(kernel, "fn", kernel)  # autotuned kernels wrap the JITFunction
    values = constexprs(D, safe_gate)
    sig, consts = {}, {}
    for name in inspect.signature(fn.fn).parameters:
        if name in values:
            sig[name] = "constexpr"
            consts[name] = values[name]
        elif name in _SCALARS:
            sig[name] = _SCALARS[name]
        elif name in _INT:
            sig[name] = "*i32"
        else:
            sig[name] = f"*{dtype}" if name in _INPUT_DTYPE else "*fp32"
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton_compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )


def resource_usage(cubin: bytes) -> dict:
    """Registers, stack (spilled registers) and shared memory per thread block of a cubin
    (cuobjdump --dump-resource-usage)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    grab = lambda key: int(m.group(1)) if (m := re.search(r"\b" + key + r":(\d+)", out)) else -1  # noqa: E731
    return {"registers": grab("REG"), "stack": grab("STACK"), "shared": grab("SHARED")}


def parser(doc: str, warps: list[int] | None, dtypes: list[str]) -> argparse.ArgumentParser:
    """The compile checks' common flags: --arch, --warps (default `warps`; None: every autotuner config's), --dtype."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    p.add_argument("--warps", type=int, nargs="+", default=warps, help=None if warps else "only configs with these")
    p.add_argument("--dtype", nargs="+", default=dtypes, choices=["fp32", "bf16", "fp16"])
    return p


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: this compiles for the GPU")
    return args


def print_header(title: str, extra: tuple[str, ...] = ()) -> None:
    """The table's title and header; `extra` columns go last (the six before them keep their places)."""
    print(title)
    columns = (
        "kernel",
        "dtype",
        "warps",
        "registers / thread",
        "stack bytes / thread (spills)",
        "shared bytes",
        *extra,
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def print_row(name: str, dtype: str, warps: int, compiled, extra: tuple[str, ...] = ()) -> None:
    """One table row: the compiled kernel's registers, spills and shared memory (cuobjdump), then `extra`."""
    usage = resource_usage(compiled.asm["cubin"])
    cells = (name, dtype, warps, usage["registers"], usage["stack"], usage["shared"], *extra)
    print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)


def main(argv=None):
    p = parser(__doc__, [4, 8], ["fp32", "bf16"])
    p.add_argument("--D", type=int, default=128, help="head dim (K = V)")
    p.add_argument("--only", nargs="+", help="kernel names (default: all)")
    args = parse(p, argv)
    print_header(f"# KDA kernels compiled for sm_{args.arch}, head dim {args.D}")
    for dtype in args.dtype:
        for name, kernel in kernels().items():
            if args.only and name not in args.only:
                continue
            for warps in args.warps:
                safe = name.endswith(_SAFE_SUFFIX)
                print_row(name, dtype, warps, compile_kernel(kernel, args.D, dtype, args.arch, warps, safe_gate=safe))


if __name__ == "__main__":
    main()
