"""The `kimi-hf` command (also `python -m kimi_hf`).

    kimi-hf quickstart [--size tiny|small|base] [--steps N] [--out DIR] [--device auto|cpu|cuda]
    kimi-hf convert kimi-linear SRC DST [...]       kimi-hf convert k25-vision TEXT K25 DST [...]
    kimi-hf serve MODEL_DIR [--port 8000]           (transformers serve for this package's models)
    kimi-hf bench NAME [...]                        (benchmarks/NAME.py of a source checkout)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

BENCHMARKS = ["kda", "model", "vision", "conversion", "attn_res", "muon_vs_adamw", "qk_clip", "optimizer_step"]


def _quickstart(argv):
    from .quickstart import SIZES, run_quickstart

    p = argparse.ArgumentParser(prog="kimi-hf quickstart", description="Build, train (MuonClip + Trainer), save, reload "
                                "and try a small early-fusion hybrid model, offline, in a few minutes on CPU.")
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--text-examples", type=int, default=2000)
    p.add_argument("--image-examples", type=int, default=2000)
    p.add_argument("--eval-images", type=int, default=64)
    p.add_argument("--out", default="outputs/quickstart")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when present")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    return run_quickstart(a.out, a.size, a.steps, a.batch_size, a.lr, a.device, a.seed, a.text_examples,
                          a.image_examples, a.eval_images, progress=not a.no_progress)


def _convert(argv):
    from .conversion.cli import k25_vision_main, kimi_linear_main

    tools = {"kimi-linear": kimi_linear_main, "k25-vision": k25_vision_main}
    if not argv or argv[0] not in tools:
        raise SystemExit(f"usage: kimi-hf convert {{{','.join(tools)}}} ARGS... (--help after the name for its options)")
    return tools[argv[0]](argv[1:])


def _serve(argv):
    from .serving import main

    return main(argv)


def _bench(argv):
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if not argv or argv[0] not in BENCHMARKS:
        raise SystemExit(f"usage: kimi-hf bench {{{','.join(BENCHMARKS)}}} ARGS... (--help after the name for its options)")
    script = os.path.join(root, f"{argv[0]}.py")
    if not os.path.exists(script):
        raise SystemExit(f"kimi-hf bench runs the benchmarks/ scripts of a source checkout; {script} does not exist")
    code = subprocess.call([sys.executable, script, *argv[1:]])  # exactly as `python benchmarks/NAME.py ...`
    if code:
        raise SystemExit(code)


COMMANDS = {"quickstart": _quickstart, "convert": _convert, "serve": _serve, "bench": _bench}


def run(argv: list[str] | None = None):
    """Runs a command and returns its result (a QuickstartResult, a conversion summary, ...)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        if not argv:
            raise SystemExit(2)  # a command is required (usage printed)
        if argv[0] not in ("-h", "--help"):
            raise SystemExit(f"unknown command {argv[0]!r}; one of: {', '.join(COMMANDS)}")
        return None
    return COMMANDS[argv[0]](argv[1:])


def main(argv: list[str] | None = None) -> int:
    """The console script: exit status 0 on success (errors exit through SystemExit / exceptions)."""
    run(argv)
    return 0

if __name__ == "__main__":
    main()
