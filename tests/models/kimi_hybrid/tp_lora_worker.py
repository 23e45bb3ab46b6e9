"""Worker of test_tensor_parallel_lora.py, run under `torchrun --nproc_per_node 2` (CPU, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tp_lora_worker.py OUT CASE_DIR:LAYOUT:TARGETS ...

For each run it loads the folder CASE_DIR (written by the test, with `inputs.pt`) in LAYOUT,

    tp:          from_pretrained(path, tp_plan="auto")
    ep:          from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, ep_size=2))
    tp-old-kv-a: tensor parallelism with the rope key's gradient summed on kv_a_proj_with_mqa itself (the rule
                 before kv_a_output; a style PEFT's adapters do not follow)

wraps it with `peft.get_peft_model(model, lora_config(model, TARGETS))` (TARGETS: "recommended", i.e.
kimi_hf.lora_target_modules(config), "all-linear", or comma-separated module names), gives every LoRA factor the same
non-zero values as the test's single process (`set_lora_weights`) and runs `lora_compute`, which the test runs in
one process too. Each rank writes OUT/<case>-<layout>-<targets>-rank<r>.pt: the results, {"refused": message} (a
ValueError, raised on both ranks) or {"crashed": traceback}.
"""

import sys
import traceback
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import kimi_hf


OLD_KV_A_RULE = {
    "model.layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "model.layers.*.self_attn.kv_a_output": "replicate",
}
LAYOUTS = {
    "tp": dict(tp_plan="auto"),
    "ep": dict(distributed_config=DistributedConfig(tp_size=2, ep_size=2)),
    "tp-old-kv-a": dict(distributed_config=DistributedConfig(tp_size=2, tp_plan=OLD_KV_A_RULE)),
}


def lora_config(model, targets: str) -> LoraConfig:
    if targets == "recommended":
        modules = kimi_hf.lora_target_modules(model.config)
    else:
        modules = targets if targets == "all-linear" else targets.split(",")
    # init_lora_weights=False: B is not zero (set_lora_weights gives both factors their values anyway)
    return LoraConfig(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False)


def set_lora_weights(model) -> None:
    """Every LoRA factor: N(0, 0.1^2) values seeded by its name, at its full shape; a sharded factor (a DTensor)
    gets this rank's part of the same values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" not in name:
                continue
            full = torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())
            else:
                p.copy_(full)


def lora_compute(model, ids: torch.Tensor) -> dict:
    """The logits of a batch without gradients and in training, the loss and every trainable parameter's gradient
    (the LoRA factors; gathered); the same function runs the single-process reference."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():  # the same order on every rank: full_tensor() is a collective
        if p.grad is not None:
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
    model.zero_grad(set_to_none=True)
    return {"logits": logits, "train_logits": out.logits.detach(), "loss": out.loss.detach(), "grads": grads}


def run(path: str, layout: str, targets: str) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **LAYOUTS[layout])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peft_model = get_peft_model(model, lora_config(model, targets))
        set_lora_weights(peft_model)
        result = lora_compute(peft_model, torch.load(Path(path) / "inputs.pt")["ids"])
        # PEFT's "TP plan ... is not supported for LoRA" (adapters left unsharded beside a sharded layer)
        result["peft_warnings"] = [str(w.message) for w in caught if "TP plan" in str(w.message)]
        return result
    except ValueError as e:  # a refusal: the same check on both ranks
        return {"refused": str(e)}
    except Exception:  # noqa: BLE001  (for the test's message; the ranks may wait on each other after this)
        return {"crashed": traceback.format_exc()[-3000:]}


def main(out: Path, runs: list[str]):
    for spec in runs:
        path, layout, targets = spec.split(":")
        result = run(path, layout, targets)
        torch.save(result, out / f"{Path(path).name}-{layout}-{targets}-rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
