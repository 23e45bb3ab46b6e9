"""Measures what `kimi-hf plan` predicts, on a real K3 folder on CPU (run by test_planner.py; alone, or under torchrun
with gloo for FSDP2): the bytes of this rank's parameters, adapters, gradients and MuonClip states (sums over the
real tensors, DTensors' local shards), and the activations as the process's allocated memory (RssAnon: with
MALLOC_MMAP_THRESHOLD_ set low every sizeable tensor is its own mapping, returned when freed) held after the forward
and at the backward's peak (VmHWM, reset before the backward), above what it held before the forward.

    python measure_worker.py FOLDER TASK(lora|full|infer) SEQ_LEN MICRO_BATCH CHECKPOINTING(0|1) FORMAT OUT.json
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def local_bytes(tensors) -> int:
    out = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        out += t.numel() * t.element_size()
    return out


def main(folder, task, seq_len, micro_batch, checkpointing, experts_format, out):
    seq_len, micro_batch, checkpointing = int(seq_len), int(micro_batch), checkpointing == "1"
    # The plan counts tensors. On a CPU with bf16 instructions (avx512_bf16 / AMX) torch runs bf16 matmuls through
    # oneDNN, whose primitive cache and reordered-weight scratch stay allocated: ~15 MB a layer here, 0.7x of what the
    # planner's tensors are, and absent on CPUs without them. The reference BLAS paths allocate only the tensors.
    torch.backends.mkldnn.enabled = False
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    from peft import LoraConfig, get_peft_model

    from kimi_hf import KimiK3ForConditionalGeneration
    from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES
    from kimi_hf.optim import MuonClip

    model = KimiK3ForConditionalGeneration.from_pretrained(
        folder, dtype=torch.bfloat16, experts_format=experts_format, attn_implementation="sdpa"
    )
    model.config.text_config.use_cache = task == "infer"
    torch.manual_seed(0)
    if task == "lora":
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=K3_LORA_TARGET_MODULES))
    if task == "infer":
        model.requires_grad_(False).eval()
    else:
        model.train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if distributed:
        from torch.distributed.fsdp import fully_shard

        base = model.get_base_model() if task == "lora" else model
        for layer in base.model.language_model.layers:
            fully_shard(layer)
        fully_shard(model)
    named = list(model.named_parameters())
    result = {
        "weights": local_bytes(p for n, p in named if ".lora_" not in n),
        "adapters": local_bytes(p for n, p in named if ".lora_" in n),
    }
    ids = torch.randint(3, 97, (micro_batch, seq_len), generator=torch.Generator().manual_seed(rank))
    if task != "infer" and not distributed:  # the gradients allocated first: the backward's peak is activations only
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    gc.collect()
    before = status("RssAnon")
    if task == "infer":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        start = status("VmHWM") - before  # VmRSS counts the mapped files too: the peak is taken above it
        with torch.no_grad():
            cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        result["activations"] = status("VmHWM") - before - start
        # what the prefill leaves for decoding: the bytes of the cache's tensors (too small for RssAnon to resolve)
        from torch.utils._pytree import tree_leaves

        leaves = tree_leaves([dict(vars(layer)) for layer in cache.layers])
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves if torch.is_tensor(t)}
        result["cache"] = sum(storages.values())
    else:
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        result["saved"] = status("RssAnon") - before
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = status("VmHWM") - status("RssAnon")
        loss.backward()
        result["activations"] = status("VmHWM") - start - before
        trainable = [p for p in model.parameters() if p.requires_grad]
        result["gradients"] = local_bytes(p.grad for p in trainable if p.grad is not None)
        optimizer = MuonClip(model, lr=1e-3)
        optimizer.step()
        result["optimizer"] = local_bytes(
            v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()
        )
    with open(out if not distributed else f"{out}.{rank}", "w") as f:  # every rank its own file
        json.dump(result, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
