"""`kimi-hf plan MODEL_DIR_OR_CONFIG --task infer|lora|full --gpus N --gpu-memory 141GB [...]`: the per-rank memory of
a job (a table, or one JSON object with --json), whether it fits, and with --suggest the smallest layout that does.
Exit status 1 when the job does not fit (the table or the JSON still printed on stdout), as when --suggest finds no
layout: a script can test the answer."""

from __future__ import annotations

import json
import sys

from ..cli_args import ArgumentParser, size


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
    p.add_argument(
        "--gpus", type=int, default=None, help="devices in all (default: one replica of the layout, times --cp)"
    )
    p.add_argument(
        "--gpu-memory", type=size, default="141GB", help="memory of one device: 141GB = 141 x 10^9 bytes (an H200)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (divides num_experts and tp x fsdp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B); with --suggest the most it may use")
    p.add_argument(
        "--fsdp", type=int, default=None, help="FSDP2 shards (default: the data ranks the other sizes leave of --gpus)"
    )
    p.add_argument("--cp", type=int, default=1, help="context parallel size: ranks splitting each sequence")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens a sequence")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences a micro-batch")
    p.add_argument("--checkpointing", action="store_true", help="activation (gradient) checkpointing of every layer")
    p.add_argument(
        "--loss-chunk-size",
        type=int,
        default=1024,
        help="the trainer's chunked head + loss, tokens a chunk (kimi-hf finetune's default; 0: whole logits)",
    )
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


GPUS_A_NODE = 8  # H100 / H200 nodes


def launch_command(plan, model: str) -> str | None:
    """The `kimi-hf finetune` launch of a training plan's layout (one command a node under torchrun; None for
    inference): its layout flags, sequence, micro-batch and checkpointing; $HEAD (node 0's address) and $DATA (the
    user's dataset) left to fill in, and $MODEL when `model` is a config file other than a folder's config.json (a
    config alone: no weights beside it to train)."""
    import os
    import shlex

    if plan.task == "infer":
        return None
    folder = model
    if model.endswith(".json"):
        folder = (os.path.dirname(model) or ".") if os.path.basename(model) == "config.json" else "$MODEL"
    n = plan.gpus
    if n <= GPUS_A_NODE:
        launch = f"torchrun --standalone --nproc-per-node {n}"
    else:
        nodes = -(-n // GPUS_A_NODE)
        launch = (
            f"torchrun --nnodes {nodes} --nproc-per-node {GPUS_A_NODE} --rdzv-backend c10d "
            "--rdzv-endpoint $HEAD:29500 --rdzv-id kimi-finetune"
        )
    args = [
        "--model",
        folder if folder == "$MODEL" else shlex.quote(folder),
        "--data",
        "$DATA",
        "--lora" if plan.task == "lora" else "--full",
    ]
    args += plan.layout.flags() + ["--seq-len", str(plan.seq_len), "--micro-batch", str(plan.micro_batch)]
    args += ["--optimizer", plan.optimizer]
    if plan.checkpointing:
        args.append("--gradient-checkpointing")
    args += ["--loss-chunk-size", str(plan.loss_chunk_size or 0)]  # the planned one, whatever finetune's default
    return f"{launch} $(which kimi-hf) finetune {' '.join(args)}"


def table(plan, suggested: bool = False, turned_on: str = "", command: str | None = None) -> str:
    """The plan as a table; `turned_on`: what --suggest turned on itself; `command`: the launch of its layout."""
    head = (
        f"{plan.task} of a {plan.total_weights / 1e12:.2f} TB model ({plan.experts_format} experts) on {plan.gpus} "
        f"GPU(s) of {_gb(plan.gpu_memory)}: {plan.layout.describe()}"
        + (f" [suggested{'; turned on: ' + turned_on if turned_on else ''}]" if suggested else "")
        + f", {plan.micro_batch} x {plan.seq_len} tokens"
        + (", checkpointing" if plan.checkpointing else "")
        + (f", loss in chunks of {plan.loss_chunk_size}" if plan.loss_chunk_size else "")
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
    if command:
        lines += ["", "launch (each node; $HEAD: node 0's address, $DATA: your dataset):", f"    {command}"]
    return "\n".join(lines)


def candidate_layouts(text_config, max_pp: int = 1, max_gpus: int = 8192, max_cp: int = 1):
    """Layouts (ParallelDims) in the order of the search: fewer devices first, then fewer pipeline stages (up to
    max_pp), then smaller tp, then less context parallelism (up to max_cp); fsdp is what the other sizes leave (as the
    trainer fills it in), and ep the largest that divides the experts and tp x fsdp."""
    from ..distributed.parallel_dims import ParallelDims

    experts = text_config.num_experts if "sparse" in text_config.mlp_layer_types else 0
    counts = [1, 2, 4] + list(range(8, max_gpus + 1, 8))
    for n in counts:
        for pp in (p for p in (1, 2, 4, 8, 16) if p <= max_pp):
            for tp in (1, 2, 4, 8):
                if n % (tp * pp) or pp > text_config.num_hidden_layers:
                    continue
                dims = ParallelDims.resolve(n, tp=tp, pp=pp)
                for cp in (c for c in (1, 2, 4, 8) if c <= max_cp and dims.data_ranks % c == 0):
                    yield ParallelDims.resolve(n, tp=tp, pp=pp, cp=cp, ep=_largest_ep(experts, tp, dims.fsdp))


def _largest_ep(experts: int, tp: int, fsdp: int) -> int:
    """The largest ep dividing the experts and tp x fsdp, a multiple of tp (1 without experts or such a size)."""
    sizes = [e for e in range(tp, tp * fsdp + 1, tp) if experts and experts % e == 0 and (tp * fsdp) % e == 0]
    return max(sizes, default=1)


def suggest(planner, gpu_memory, headroom: float, max_pp: int = 1, max_cp: int = 8):
    """The first layout of candidate_layouts that fits, as a MemoryPlan; ValueError when none up to 8192 devices.
    Without --checkpointing a device count is tried as asked first, then with activation checkpointing turned on
    (the plan says so). Layouts whose weights, gradients and optimizer states alone overflow a device are skipped
    without tracing their activations."""
    import copy

    from ..sizes import parse_size

    usable = int(parse_size(gpu_memory, "--gpu-memory") * (1 - headroom))
    planners = [planner]
    if not planner.checkpointing and planner.task != "infer":
        recomputing = copy.copy(planner)
        recomputing.checkpointing, recomputing._traces = True, {}
        planners.append(recomputing)
    seq_len = planner.seq_len if planner.task != "infer" else None
    by_count: dict[int, list] = {}
    for layout in candidate_layouts(planner.text, max_pp, max_cp=max_cp if planner.task != "infer" else 1):
        by_count.setdefault(layout.world, []).append(layout)
    for _, layouts in sorted(by_count.items()):
        runnable = []
        for layout in layouts:  # the checks that do not depend on checkpointing, once
            try:
                layout.check(planner.text, seq_len=seq_len)
            except ValueError:  # e.g. tp not dividing the heads: not a layout the trainer runs
                continue
            if planner.static_bytes(layout) <= usable:
                runnable.append(layout)
        for option in planners:
            for layout in runnable:
                plan = option.plan(layout, gpu_memory, headroom)
                if plan.fits:
                    return plan
    raise ValueError("--suggest: no layout of up to 8192 devices fits this job (a shorter --seq-len?)")


def main(argv=None, prog: str = "kimi-hf plan"):
    a = parser(prog).parse_args(argv)
    from ..distributed.parallel_dims import ParallelDims
    from .planner import Planner, load_config, resolve_experts_format

    # bad flags fail before the model is built (--gpu-memory: argparse already read it)
    config = load_config(a.model)
    layout = None
    if not a.suggest:
        resolve_experts_format(config, a.task, a.experts_format)  # a bad --experts-format fails here too
        world = a.gpus if a.gpus is not None else a.pp * a.tp * (a.fsdp if a.fsdp is not None else a.cp)
        sizes = dict(tp=a.tp, ep=a.ep, pp=a.pp, cp=a.cp, fsdp=a.fsdp)
        seq_len = a.seq_len if a.task != "infer" else None
        try:
            layout = ParallelDims.for_model(world, config.get_text_config(), seq_len=seq_len, **sizes)
        except ValueError as e:  # the trainer's words for a launched job; here the world is --gpus
            raise ValueError(str(e).replace("the world size", "--gpus")) from None
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
        loss_chunk_size=a.loss_chunk_size or None,
    )
    if a.suggest:
        plan = suggest(planner, a.gpu_memory, a.headroom, max_pp=a.pp)
    else:
        plan = planner.plan(layout, a.gpu_memory, a.headroom)
    command = launch_command(plan, a.model)
    turned_on = ", ".join(
        what
        for what, on in (
            ("activation checkpointing", plan.checkpointing and not a.checkpointing),
            (f"context parallelism (--cp {plan.layout.cp})", plan.layout.cp > a.cp),
            (f"pipeline stages (--pp {plan.layout.pp})", plan.layout.pp > 1),
        )
        if on
    )
    if a.json:
        print(json.dumps({**plan.to_json(), "command": command}))
    else:
        print(table(plan, suggested=a.suggest, turned_on=turned_on if a.suggest else "", command=command))
    sys.stdout.flush()
    if not plan.fits:  # a "no" is a failure, as --suggest finding nothing is: exit status 1, one line on stderr
        raise SystemExit(
            f"the job does not fit: {_gb(plan.per_rank['total'])} a rank, {_gb(plan.usable)} usable "
            f"(--gpu-memory less --headroom); --suggest finds the smallest layout that fits"
        )
    return plan
