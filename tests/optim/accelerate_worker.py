"""Run by test_accelerate_launch.py under `accelerate launch --config_file examples/accelerate/<config>.yaml`: train
the tiny hybrid model and / or a tiny Kimi K3 (test_distributed.build; "k3-images": with an image in one rank's rows
at some steps) for a few MuonClip steps through `Accelerator.prepare`, with expert balancing, and write what each
rank saw (its rank, the world size, accelerate's distributed type, the wrapper, the FSDP units, the losses) and,
from rank 0, the full trained parameters.

    accelerate launch --config_file examples/accelerate/cpu_ddp.yaml tests/optim/accelerate_worker.py OUT hybrid k3

Before training it runs accelerate_probe.check_setup, which refuses what accelerate would run silently instead of
what the launch asked for (every process alone; DDP for an FSDP config on CPU). With `--force-fsdp2-on-cpu` the
worker selects FSDP itself after `Accelerator(cpu=True)`, as accelerate's AcceleratorState does on GPUs, so that
accelerate's own FSDP2 preparation (`fsdp2_prepare_model`: the config's auto wrap policy, the embedding and head
units, the optimizer's parameters swapped for the DTensors) runs on gloo.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kimi_hf.optim import MuonClip, track_expert_load, update_expert_bias
from tests.optim.accelerate_probe import check_setup
from tests.optim.distributed_helpers import STEPS, batch, build, qk_clip_tau


LR = 1e-2
EXPERT_BIAS_RATE = 1e-2
ARCHS = ("hybrid", "k3", "k3-images")
WORLD = 2
IMAGE_TOKEN = 99  # build("k3")'s media_token_id
IMAGE_RANK = {0: 0, 1: None, 2: 1}  # "k3-images": which rank's rows hold an image at each step


def micro_batches(arch: str, step: int) -> list[dict]:
    """The model inputs of each of the WORLD ranks at `step`: its rows of the one global batch. "k3-images": the
    first of its rows holds an image (4 placeholders: a 4 x 4 patch grid, merged 2 x 2) on one rank at steps 0
    and 2 (rank 0, then rank 1), on none at step 1: the ranks' vision towers run, or not, independently."""
    x = batch(step)
    parts = [{"input_ids": x[r::WORLD], "labels": x[r::WORLD]} for r in range(WORLD)]
    r = IMAGE_RANK[step] if arch == "k3-images" else None
    if r is not None:
        ids = parts[r]["input_ids"].clone()
        ids[0, 2:6] = IMAGE_TOKEN
        g = torch.Generator().manual_seed(200 + step)
        parts[r] = {
            "input_ids": ids,
            "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100),
            "pixel_values": torch.randn(16, 3, 14, 14, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
        }
    return parts


def force_fsdp_on_cpu(accelerator) -> None:
    """Select FSDP on a MULTI_CPU (gloo) state, with the plugin read from the launch's FSDP_* variables: what
    AcceleratorState does for MULTI_GPU / MULTI_XPU / ... and never for MULTI_CPU (accelerate 1.x)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(f"--force-fsdp2-on-cpu needs a MULTI_CPU (gloo) run, got {accelerator.distributed_type}")
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise RuntimeError(f"--force-fsdp2-on-cpu needs fsdp_version: 2 in the config, got {plugin.fsdp_version}")
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).contiguous().cpu()


def expert_biases(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone().cpu() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def build_arch(arch: str):
    return build("k3" if arch == "k3-images" else arch).train()


def reference(arch: str):
    """The same training in one process, without accelerate: (parameters, expert biases, losses, clipped heads).
    The text runs take the whole batch at once; "k3-images" the mean of the ranks' losses (their rows differ)."""
    torch.manual_seed(0)
    model = build_arch(arch)
    opt = MuonClip.from_model(model, lr=LR, qk_clip_tau=qk_clip_tau(arch))
    track_expert_load(model)
    losses = []
    for step in range(STEPS):
        if arch == "k3-images":
            loss = sum(model(**part, use_cache=False).loss for part in micro_batches(arch, step)) / WORLD
        else:
            x = batch(step)
            loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        update_expert_bias(model, update_rate=EXPERT_BIAS_RATE)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, expert_biases(model), losses, opt.qk_clip.total_clipped_heads


def train(accelerator, arch: str, out: Path, gradient_checkpointing: bool = False) -> None:
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    rank, world = accelerator.process_index, accelerator.num_processes
    if world != WORLD:
        raise RuntimeError(f"the worker trains on {WORLD} processes, got {world}")
    torch.manual_seed(0)
    model = build_arch(arch)
    if gradient_checkpointing:
        model.activation_checkpointing_enable()  # transformers' (the layers checkpoint themselves: no wrapper)
    opt = MuonClip.from_model(model, lr=LR, qk_clip_tau=qk_clip_tau(arch))
    track_expert_load(model)  # the routers' hooks live on the modules, which DDP / FSDP2 keep
    model, opt = accelerator.prepare(model, opt)
    inner = accelerator.unwrap_model(model)
    info = {
        "rank": rank,
        "world_size": world,
        "pid": os.getpid(),
        "distributed_type": accelerator.distributed_type.value,
        "wrapper": type(model).__name__,
        "fsdp_units": sorted(
            type(m).__name__ for m in inner.modules() if isinstance(m, FSDPModule) and m is not inner
        ),
    }
    if accelerator.distributed_type == DistributedType.FSDP:
        sharded = {n: list(q.to_local().shape) for n, q in inner.named_parameters() if isinstance(q, DTensor)}
        info["dtensor_params"] = len(sharded)
        info["params"] = sum(1 for _ in inner.parameters())
        info["lm_head_local_shape"] = sharded["lm_head.weight"]
    losses = []
    for step in range(STEPS):
        part = {k: v.to(accelerator.device) for k, v in micro_batches(arch, step)[rank].items()}
        loss = model(**part, use_cache=False).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        update_expert_bias(inner, update_rate=EXPERT_BIAS_RATE)  # the ranks' expert loads summed
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    info["losses"] = losses
    info["clipped_heads"] = opt.optimizer.qk_clip.total_clipped_heads
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    full = {n: full_tensor(q) for n, q in inner.named_parameters()}  # a collective under FSDP2: every rank
    full.update(expert_biases(inner))
    if accelerator.is_main_process:
        save_file(full, out / "model.safetensors")
    accelerator.wait_for_everyone()
    os.write(1, f"{arch}: rank {rank}/{world} {info['distributed_type']} {info['wrapper']}\n".encode())


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("archs", nargs="+", choices=ARCHS)
    p.add_argument("--force-fsdp2-on-cpu", action="store_true")
    p.add_argument("--gradient-checkpointing", action="store_true")
    args = p.parse_args(argv)

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if args.force_fsdp2_on_cpu:
        force_fsdp_on_cpu(accelerator)
    check_setup(accelerator)
    for arch in args.archs:
        train(accelerator, arch, Path(args.out) / arch, args.gradient_checkpointing)
    accelerator.end_training()


if __name__ == "__main__":
    main()
