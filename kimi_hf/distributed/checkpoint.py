"""Sharded training checkpoints on torch.distributed.checkpoint (DCP): the model's trainable state (all of it, or
a LoRA run's adapters, plus the buffers: the routers' expert biases), the optimizer's states (MuonClip's momentum,
AdamW's moments, by parameter name), the learning-rate scheduler, the step (the data position) and the RNG.

Every rank writes its own shards (FSDP2's rows, a pipeline stage's layers) under the whole model's parameter names,
flattened optimizer states included, so a checkpoint loads onto another layout: another pipeline split, FSDP2 over
more or fewer ranks, one process (DCP reshards on load).

    state = TrainState(model, optimizer, scheduler, trainable_only=lora)
    save_checkpoint(folder, state, step)      # folder/step-N, written as folder/.step-N.tmp then installed
    step = load_checkpoint(folder, state)     # the latest step-N; the next step to run is the returned one
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from ..conversion.output_dir import discard, install


STEP_DIR = re.compile(r"^step-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class TrainState(Stateful):
    """What a resumed run needs, as DCP's Stateful: `state_dict()` is taken at save time, `load_state_dict` fills
    the live objects in place. `trainable_only`: save the parameters that train (LoRA's adapters) and the buffers,
    not the frozen base weights (they come from the model folder again)."""

    def __init__(self, model, optimizer, scheduler=None, *, trainable_only: bool = False, step: int = 0):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, flatten_optimizer_state_dict=True)
        # loading a LoRA run's adapters leaves the frozen base weights as loaded from the folder (DCP itself refuses
        # a key the checkpoint lacks)
        self.load_options = StateDictOptions(
            ignore_frozen_params=trainable_only, flatten_optimizer_state_dict=True, strict=not trainable_only
        )
        self.step = step

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        out = {"model": model_sd, "optimizer": optim_sd, "step": self.step, "rng": torch.get_rng_state()}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
            options=self.load_options,
        )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        self.step = int(state_dict["step"])
        torch.set_rng_state(state_dict["rng"])


def checkpoint_steps(folder: str) -> list[int]:
    """The steps saved under `folder` (complete checkpoints only: step-N folders), ascending."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(folder) if (m := STEP_DIR.match(name)))


def save_checkpoint(folder: str, state: TrainState, step: int) -> str:
    """Saves `state` at `step` (the number of optimizer steps taken) as folder/step-N on every rank (a
    collective). DCP writes it into folder/.step-N.tmp (a leftover of a crashed save is removed first), which is
    installed as step-N once every rank has finished (`conversion.output_dir.install`: an existing step-N is
    replaced only then), so a crash never leaves a step-N that does not load. The folder and DCP's files get
    mkdir's / open()'s modes (0755 / 0644 under umask 022), as ordinary checkpoints."""
    final = os.path.join(folder, f"step-{step}")
    tmp = os.path.join(folder, f".step-{step}.tmp")  # the same name on every rank: DCP's checkpoint_id
    if _rank() == 0:
        os.makedirs(folder, exist_ok=True)
        discard(tmp)
    _barrier()
    state.step = step
    try:
        dcp.save({"train": state}, checkpoint_id=tmp)
        _barrier()
        if _rank() == 0:
            install(tmp, final, overwrite=True)
    except BaseException:
        if _rank() == 0:
            discard(tmp)
        raise
    _barrier()
    return final


def load_checkpoint(folder: str, state: TrainState, step: int | None = None) -> int:
    """Loads folder/step-N (the latest when `step` is None) into `state` (a collective); returns its step. A
    folder without a complete checkpoint is a ValueError naming it."""
    steps = checkpoint_steps(folder)
    if not steps:
        raise ValueError(f"--checkpoint-dir {folder}: no checkpoint (step-N folder) to resume from")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise ValueError(f"--checkpoint-dir {folder}: no step-{step} (saved: {steps})")
    dcp.load({"train": state}, checkpoint_id=os.path.join(folder, f"step-{step}"))
    return state.step


__all__ = ["TrainState", "checkpoint_steps", "load_checkpoint", "save_checkpoint"]
