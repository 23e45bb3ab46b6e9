"""`kimi-hf plan MODEL_DIR_OR_CONFIG --task infer|lora|full --gpus N --gpu-memory 141GB [...]`: the per-rank memory of
a job (a table, or one JSON object with --json), whether it fits, and with --suggest the smallest layout that does.
Exit status 1 when the job does not fit (the table or the JSON still printed on stdout), as when --suggest finds no
layout: a script can test the answer."""

from __future__ import annotations

import json
import sys

from ..cli_args import ArgumentParser, size
from .layout import Layout


def parser(prog: str = "kimi-hf plan") -> ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description="Per-rank memory of a Kimi K3 / Kimi Linear job (weights, LoRA adapters, gradients, optimizer "
        "states, activations, decode cache) from its config.json alone, for a parallel layout; whether it fits; "
        "--suggest: the smallest layout that fits. Sizes in bytes (GB = 10^9, GiB = 2^30, as in transformers). Exit "
        "status 1 when the job does not fit (the output still printed).",
    )
    p.add_argument(
        "model", metavar="MODEL_DIR_OR_CONFIG", help="a model folder or its config.json (no weights needed)"
    )
    p.add_argument(
        "--task", choices=["infer", "lora", "full"], default="lora", help="inference, LoRA or full fine-tuning"
    )
    p.add_argument("--gpus", type=int, default=None, help="devices in all (default: one replica of the layout)")
    p.add_argument(
        "--gpu-memory", type=size, default="141GB", help="memory of one device: 141GB = 141 x 10^9 bytes (an H200)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (divides num_experts and tp x fsdp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B); with --suggest the most it may use")
    p.add_argument("--fsdp", type=int, default=1, help="FSDP2 shards")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens a sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences a micro-batch")
    p.add_argument("--checkpointing", action="store_true", help="activation (gradient) checkpointing of every layer")
    p.add_argument(
        "--experts-format",
        choices=["mxfp4", "dense"],
        default=None,
        help="routed experts resident in "
        "MXFP4 or dequantised (default: mxfp4 for an MXFP4 config, except --task full)",
    )
    p.add_argument("--optimizer", choices=["muonclip", "adamw"], default="muonclip", help="training optimizer")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (on kimi_hf.lora_target_modules(config))")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None, help="default: the config's")
    p.add_argument(
        "--headroom",
        type=float,
        default=0.08,
        help="fraction of each device kept free (CUDA context, communication buffers, fragmentation)",
    )
    p.add_argument(
        "--suggest",
        action="store_true",
        help="search the smallest layout that fits (tp <= 8 a node; ignores --tp / --ep / --fsdp / --gpus)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def _gb(n: int) -> str:
    """Bytes in GB (10^9), or MB / KB below them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1e3:,.1f} KB"


def table(plan, suggested: bool = False) -> str:
    lay = plan.layout
    head = (
        f"{plan.task} of a {plan.total_weights / 1e12:.2f} TB model ({plan.experts_format} experts) on {plan.gpus} "
        f"GPU(s) of {_gb(plan.gpu_memory)}: tp {lay.tp} x ep {lay.ep} x pp {lay.pp} x fsdp {lay.fsdp}"
        f" (x {plan.dp_replicate} replicas)"
        + (" [suggested]" if suggested else "")
        + f", {plan.micro_batch} x {plan.seq_len} tokens"
        + (", checkpointing" if plan.checkpointing else "")
        + (f", {plan.optimizer}" if plan.task != "infer" else "")
    )
    rows = []
    for key, value in plan.per_rank.items():
        if key != "total":
            rows.append(f"| {key} | {_gb(value)} |")
        if key == "activations":  # where they are held: the layers by mixer, the rest, the backward's transient
            rows += [f"| - {part.replace('_', ' ')} | {_gb(v)} |" for part, v in plan.activation_parts.items()]
    verdict = "fits" if plan.fits else "does NOT fit"
    lines = [
        head,
        "",
        "| per rank (fullest: pipeline stage %d) | bytes |" % plan.stage,
        "|---|---|",
        *rows,
        f"| **total** | **{_gb(plan.per_rank['total'])}** |",
        "",
        f"{verdict}: {_gb(plan.per_rank['total'])} of {_gb(plan.usable)} usable a device "
        f"({_gb(plan.gpu_memory)} less the headroom)",
        f"decode cache: {_gb(plan.cache_per_token)} a token + {_gb(plan.cache_per_sequence)} a sequence (one rank)",
    ]
    if plan.task != "infer":
        lines.append(f"trainable parameters: {plan.trainable:,}")
    return "\n".join(lines)


def candidate_layouts(text_config, max_pp: int = 1, max_gpus: int = 8192):
    """Layouts in the order of the search: fewer devices first, then fewer pipeline stages (up to max_pp), then smaller
    tp; the rest of a replica goes to FSDP, and ep is the largest that divides the experts and tp x fsdp."""
    experts = text_config.num_experts if "sparse" in text_config.mlp_layer_types else 0
    counts = [1, 2, 4] + list(range(8, max_gpus + 1, 8))
    for n in counts:
        for pp in (p for p in (1, 2, 4, 8, 16) if p <= max_pp):
            for tp in (1, 2, 4, 8):
                if n % (tp * pp) or pp > text_config.num_hidden_layers:
                    continue
                fsdp = n // (tp * pp)
                yield n, Layout(tp=tp, ep=_largest_ep(experts, tp, fsdp), pp=pp, fsdp=fsdp)


def _largest_ep(experts: int, tp: int, fsdp: int) -> int:
    """The largest ep dividing the experts and tp x fsdp, a multiple of tp (1 without experts or such a size)."""
    sizes = [e for e in range(tp, tp * fsdp + 1, tp) if experts and experts % e == 0 and (tp * fsdp) % e == 0]
    return max(sizes, default=1)


def suggest(planner, gpu_memory, headroom: float, max_pp: int = 1):
    """The first layout of candidate_layouts that fits, as a MemoryPlan; ValueError when none up to 8192 devices."""
    for n, layout in candidate_layouts(planner.text, max_pp):
        try:
            plan = planner.plan(layout, n, gpu_memory, headroom)
        except ValueError:  # e.g. tp not dividing the heads
            continue
        if plan.fits:
            return plan
    raise ValueError("--suggest: no layout of up to 8192 devices fits this job (shorter --seq-len, --checkpointing?)")


def main(argv=None, prog: str = "kimi-hf plan"):
    a = parser(prog).parse_args(argv)
    from .layout import check_layout
    from .planner import Planner, load_config, resolve_experts_format

    # bad flags fail before the model is built (--gpu-memory: argparse already read it)
    config = load_config(a.model)
    layout = Layout(tp=a.tp, ep=a.ep, pp=a.pp, fsdp=a.fsdp)
    if not a.suggest:
        resolve_experts_format(config, a.task, a.experts_format)  # a bad --experts-format fails here too
        check_layout(layout, layout.replica if a.gpus is None else a.gpus, config.get_text_config())
    planner = Planner(
        config,
        task=a.task,
        experts_format=a.experts_format,
        seq_len=a.seq_len,
        micro_batch=a.micro_batch,
        checkpointing=a.checkpointing,
        optimizer=a.optimizer,
        lora_rank=a.lora_rank,
        dtype=a.dtype,
    )
    if a.suggest:
        plan = suggest(planner, a.gpu_memory, a.headroom, max_pp=a.pp)
    else:
        plan = planner.plan(layout, a.gpus, a.gpu_memory, a.headroom)
    if a.json:
        print(json.dumps(plan.to_json()))
    else:
        print(table(plan, suggested=a.suggest))
    sys.stdout.flush()
    if not plan.fits:  # a "no" is a failure, as --suggest finding nothing is: exit status 1, one line on stderr
        raise SystemExit(
            f"the job does not fit: {_gb(plan.per_rank['total'])} a rank, {_gb(plan.usable)} usable "
            f"(--gpu-memory less --headroom); --suggest finds the smallest layout that fits"
        )
    return plan
