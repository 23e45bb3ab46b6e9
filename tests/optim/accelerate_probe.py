"""What `accelerate launch` starts on a machine without GPUs (accelerate 1.x), and a guard against what it does
silently. Run by test_accelerate_launch.py: from every process it starts, one line `PROBE {json}` with what
accelerate made of the launch (torch and accelerate only: a launch costs a few seconds).

    accelerate launch [--config_file CONFIG] tests/optim/accelerate_probe.py [--cpu] [--check]

--cpu: Accelerator(cpu=True), what a training script on a machine without GPUs must pass (or ACCELERATE_USE_CPU=1 in
the environment) for the processes that torchrun starts to join over gloo.
--check: then `check_setup`, which accelerate_worker.py runs before training.
"""

import json
import os
import sys

import torch
from accelerate import Accelerator


def check_setup(accelerator) -> None:
    """Fail loudly where accelerate would silently run another setup than the launch asked for:
    - torchrun started WORLD_SIZE processes but accelerate runs each of them alone (`Accelerator()` without
      `cpu=True` on a machine without GPUs: DistributedType.NO, every process trains the whole batch by itself);
    - the config asks for FSDP (ACCELERATE_USE_FSDP) but accelerate prepared something else (accelerate selects
      FSDP only for accelerator devices: on CPU the gloo run is MULTI_CPU, and `prepare` wraps the model in DDP)."""
    from accelerate.utils import DistributedType

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != accelerator.num_processes:
        raise RuntimeError(
            f"{launched} processes were launched (WORLD_SIZE) but accelerate runs {accelerator.num_processes} "
            f"({accelerator.distributed_type}): without a GPU, Accelerator() needs cpu=True (or ACCELERATE_USE_CPU=1) "
            "to join the processes over gloo; otherwise each process trains alone"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and (
        accelerator.distributed_type != DistributedType.FSDP
    ):
        raise RuntimeError(
            f"the accelerate config asks for FSDP but accelerate prepared {accelerator.distributed_type}: accelerate "
            "selects FSDP only on accelerator devices (MULTI_GPU, MULTI_XPU, ...); on CPU (MULTI_CPU, gloo) it wraps "
            "the model in DDP instead. On CPU use torch's fully_shard by hand (tests/optim/fsdp2_worker.py); on GPUs "
            "examples/accelerate/fsdp2.yaml"
        )


def main():
    accelerator = Accelerator(cpu="--cpu" in sys.argv[1:])
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    state = {
        "pid": os.getpid(),
        "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
        "ACCELERATE_USE_FSDP": os.environ.get("ACCELERATE_USE_FSDP"),
        "distributed_type": accelerator.distributed_type.value,
        "backend": accelerator.state.backend,
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "wrapper": type(model).__name__,
    }
    os.write(1, f"PROBE {json.dumps(state)}\n".encode())  # one write: the processes share the pipe
    if "--check" in sys.argv[1:]:
        check_setup(accelerator)
    accelerator.end_training()


if __name__ == "__main__":
    main()
