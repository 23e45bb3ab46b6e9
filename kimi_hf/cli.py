"""The `kimi-hf` command (also `python -m kimi_hf`).

    kimi-hf quickstart [--arch k3|kimi-linear] [--size tiny|small|base] [--steps N] [--out DIR] [--device auto|cpu|cuda]
    kimi-hf convert kimi-linear SRC DST [...]       kimi-hf convert k25-vision TEXT K25 DST [...]
    kimi-hf convert k3 SRC DST [...]                (Kimi K3 with its MXFP4 experts dequantised)
    kimi-hf plan MODEL_DIR_OR_CONFIG --task infer|lora|full --gpus N [...]   (per-rank memory of a K3 job)
    kimi-hf serve MODEL_DIR [--port 8000]           (transformers serve for this package's models)
    kimi-hf finetune --model DIR --data PATH [...]  (LoRA / full fine-tuning on any layout; torchrun for several)
    kimi-hf bench NAME [...]                        (benchmarks/NAME.py of a source checkout)
    kimi-hf bench claims CLAIM [--quick]            (benchmarks/claims/CLAIM.py: docs/claims.md)

`kimi-hf COMMAND --help` shows a command's options. Errors are printed on one line; set
KIMI_HF_TRACEBACK=1 to get the Python traceback instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from . import __version__
from .cli_args import ArgumentParser, one_line


PROG = "kimi-hf"
COMMAND_HELP = {
    "quickstart": "build, train, save, reload and try a small early-fusion hybrid model (offline, CPU)",
    "convert": "convert checkpoints: kimi-linear (Kimi Linear namings), k25-vision (add K2.5's vision tower), "
    "k3 (dequantise Kimi K3's MXFP4 experts)",
    "plan": "per-rank memory of a K3 job (weights, adapters, gradients, optimizer, activations) and the layout that fits",
    "serve": "an OpenAI-compatible HTTP server (transformers serve) for this package's models",
    "finetune": "fine-tune Kimi K3 / Kimi Linear on your data (LoRA or full) on any parallel layout",
    "bench": "run one of the benchmarks/ scripts of a source checkout",
}
CONVERTERS = {
    "kimi-linear": "convert a Kimi Linear checkpoint between Moonshot's / transformers' naming and kimi_hf's",
    "k25-vision": "assemble a hybrid text checkpoint and Kimi K2.5's vision tower into an early-fusion one",
    "k3": "dequantise a Kimi K3 folder's MXFP4 routed experts (official K3 names, bf16 / fp16 / fp32)",
}
# `kimi-hf bench NAME` runs benchmarks/NAME.py: this table is the list (choices and --help); tests/test_cli.py checks
# it against the scripts of benchmarks/ that have a __main__ block, both ways
BENCHMARKS = {
    "kda": "the KDA operator: ours vs transformers' torch fallbacks on CPU (--cuda: Triton vs fla)",
    "kda_cuda": "the KDA operator on CUDA: kimi_hf's Triton kernels vs fla's (what kda --cuda runs)",
    "model": "the hybrid model vs transformers' KimiLinearForCausalLM on CPU: forward, decode, cache size",
    "vision": "the vision tower vs transformers' kimi_k25 tower on CPU",
    "conversion": "the streaming converter's peak memory against the checkpoint size",
    "attn_res": "Block Attention Residuals vs the residual sum: loss, hidden-state RMS, overhead",
    "muon_vs_adamw": "token efficiency of MuonClip vs AdamW on a byte-level hybrid LM",
    "qk_clip": "QK-Clip keeping the max attention logit at or below tau",
    "optimizer_step": "optimizer step time: MuonClip vs torch.optim.Muon + AdamW",
    "k3": "Kimi K3's architecture on CPU: the cost of AttnRes + LatentMoE, loading a released-layout folder",
    "k3_lora_memory": "LoRA over K3's routed experts kept in MXFP4 vs dequantised: peak memory of a training step",
    "k3_rank_load": "loading K3 per rank (gloo ranks): each rank's peak against its share of the model",
    "k3_context_memory": "context parallelism: memory per rank of a training step on one long sequence, 1 / 2 / 4 ranks",
    "k3_export": "the streaming export of a trained K3 checkpoint: peak memory against the model it writes",
    "chunked_loss": "the LM head + loss in chunks of tokens (loss_chunk_size) vs the whole logits: peak memory, time",
    "claims": "the seeds' claims as experiments: `kimi-hf bench claims CLAIM [--quick]` (benchmarks/claims/CLAIM.py)",
}
# `kimi-hf bench claims CLAIM` runs benchmarks/claims/CLAIM.py (docs/claims.md); tests/test_cli.py checks this table
# against that folder's scripts with a __main__ block
CLAIMS = {
    "parl": "a PARL orchestrator trained with GRPO: serial collapse, spurious parallelism, critical steps",
    "recall": "per-channel (KDA) vs per-head (Gated DeltaNet's) forgetting vs MLA on synthetic recall (MQAR, Palindrome)",
    "hybrid-ratio": "KDA : MLA ratios 0:1, 1:1, 3:1, 7:1, 1:0 at equal size and steps: validation loss",
    "long-context": "decode time and cache bytes against context length: the 3:1 hybrid vs all-MLA",
}
# what a command raises for bad input or a failed run: printed on one line, not as a traceback
USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Option defaults in the help."""


def _choose(
    prog: str, what: str, choices: dict[str, str], argv: list[str], description: str = "", version: str | None = None
) -> str:
    """The NAME of `prog NAME ARGS...`: `--help` lists the choices (exit 0); a missing or unknown NAME,
    or an option before it, is a usage error (exit 2)."""
    width = max(15, *map(len, choices))
    listing = "\n".join(f"  {name:<{width}} {text}" for name, text in choices.items())
    p = ArgumentParser(
        prog=prog,
        usage=f"{prog} [-h]{' [--version]' if version else ''} {what} [ARGS...]",
        description=f"{description.strip()}\n\n{what}:\n{listing}".strip(),
        epilog=f"'{prog} {what} --help' shows the options of {what}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if version:
        p.add_argument("--version", action="version", version=version)
    p.add_argument("name", metavar=what, choices=choices, help=f"one of: {', '.join(choices)}")
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version" if version else "-h"):
        p.error(f"unrecognized arguments: {argv[0]} ({what} comes first)")
    return p.parse_args(argv[:1]).name  # the rest belongs to NAME's own parser


def quickstart_parser() -> ArgumentParser:
    from .quickstart import ARCHS, SIZES  # no torch import: --help stays fast

    p = ArgumentParser(
        prog=f"{PROG} quickstart",
        formatter_class=_HelpFormatter,
        description="Build, train (MuonClip + Trainer), save, reload and try a small early-fusion "
        "model of the Kimi K3 architecture, offline, in a few minutes on CPU. Writes OUT/model, OUT/trainer, OUT/loss.png, "
        "OUT/question.png and OUT/summary.json (all checked before any work).",
    )
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="model size: " + "; ".join(f"{k}: hidden {v['hidden']}, {v['layers']} layers" for k, v in SIZES.items()),
    )
    p.add_argument(
        "--arch",
        choices=sorted(ARCHS),
        default="k3",
        help="k3: Kimi K3's architecture, checkpoint layout and chat format; kimi-linear: the previous model "
        "(Kimi Linear's decoder, Kimi K2's chat markup)",
    )
    p.add_argument("--steps", type=int, default=500, help="training steps")
    p.add_argument("--batch-size", type=int, default=16, help="examples per training step")
    p.add_argument("--lr", type=float, default=5e-3, help="MuonClip learning rate (cosine schedule)")
    p.add_argument("--text-examples", type=int, default=1000, help="training examples of standard-library source text")
    p.add_argument("--image-examples", type=int, default=4000, help="training examples of generated scenes to count")
    p.add_argument("--eval-images", type=int, default=256, help="held-out scenes for the counting accuracy")
    p.add_argument("--out", default="outputs/quickstart", help="output directory (created if missing)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA when present")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the initialisation and the training order")
    p.add_argument("--no-progress", action="store_true", help="no training progress bar")
    return p


def _quickstart(argv):
    a = quickstart_parser().parse_args(argv)
    from .quickstart import run_quickstart

    # run_quickstart checks its arguments and every output path before it does any work
    return run_quickstart(
        a.out,
        a.size,
        a.steps,
        a.batch_size,
        a.lr,
        a.device,
        a.seed,
        a.text_examples,
        a.image_examples,
        a.eval_images,
        progress=not a.no_progress,
        arch=a.arch,
    )


def _convert(argv):
    name = _choose(
        f"{PROG} convert",
        "CONVERTER",
        CONVERTERS,
        argv,
        description="Convert checkpoints (streaming, sharded, atomic: a failed run leaves no output).",
    )
    from .conversion.cli import k3_main, k25_vision_main, kimi_linear_main  # torch-free until they convert

    main = {"kimi-linear": kimi_linear_main, "k25-vision": k25_vision_main, "k3": k3_main}[name]
    return main(argv[1:], prog=f"{PROG} convert {name}")


def _plan(argv):
    from .plan.cli import main  # torch is imported once the flags are read

    return main(argv, prog=f"{PROG} plan")


def _serve(argv):
    # kimi_hf.serving parses the arguments, and checks MODEL_DIR before the server starts
    from .serving import main

    return main(argv, prog=f"{PROG} serve")


def _finetune(argv):
    from .finetune.cli import main  # torch is imported once the flags are read

    main(argv, prog=f"{PROG} finetune")


def _bench(argv):
    name = _choose(
        f"{PROG} bench",
        "NAME",
        BENCHMARKS,
        argv,
        description="Run benchmarks/NAME.py of a source checkout, as `python benchmarks/NAME.py ARGS...`.",
    )
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    script = os.path.join(bench, f"{name}.py")
    if name == "claims":
        argv = argv[1:]
        name = _choose(
            f"{PROG} bench claims",
            "CLAIM",
            CLAIMS,
            argv,
            description="Run benchmarks/claims/CLAIM.py of a source checkout (docs/claims.md): one claim of the "
            "seed articles as an experiment that prints its table and writes its plot; --quick for a smoke run.",
        )
        script = os.path.join(bench, "claims", f"{name.replace('-', '_')}.py")
        name = f"claims {name}"
    if not os.path.exists(script):
        raise FileNotFoundError(
            f"kimi-hf bench runs the benchmarks/ scripts of a source checkout; {script} does not exist"
        )
    # KIMI_HF_PROG: the script's argparse names `kimi-hf bench NAME` in its usage (benchmarks/common.py)
    env = {**os.environ, "KIMI_HF_PROG": f"{PROG} bench {name}"}
    code = subprocess.call([sys.executable, script, *argv[1:]], env=env)  # exactly as `python benchmarks/NAME.py ...`
    if code:
        raise SystemExit(code)


COMMANDS = {
    "quickstart": _quickstart,
    "convert": _convert,
    "plan": _plan,
    "serve": _serve,
    "finetune": _finetune,
    "bench": _bench,
}


def run(argv: list[str] | None = None):
    """Runs a command and returns its result (a QuickstartResult, a conversion summary, ...). Errors raise:
    usage errors and --help / --version exit through SystemExit (2 and 0), a failing command raises its error, and
    a `plan` that does not fit raises SystemExit with its one-line message (exit status 1) once it is printed."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = _choose(PROG, "COMMAND", COMMAND_HELP, argv, description=__doc__, version=f"{PROG} {__version__}")
    return COMMANDS[name](argv[1:])


def main(argv: list[str] | None = None) -> int:
    """The console script: runs a command and returns its exit status (0 success, 1 a failed command or a `plan`
    that does not fit, 2 a usage error, 130 interrupted); errors are printed on one line to stderr as
    `kimi-hf: error: ...`."""
    try:
        run(argv)
    except SystemExit as e:  # argparse (help: 0, usage: 2), a benchmark's status, or a message
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 1
    except USER_ERRORS as e:
        if os.environ.get("KIMI_HF_TRACEBACK"):
            raise
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
