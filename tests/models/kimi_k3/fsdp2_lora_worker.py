"""Run by test_lora_mxfp4.py under torchrun (gloo, CPU): LoRA over Kimi K3's resident MXFP4 experts on FSDP2
(torch's fully_shard on every decoder layer and the model: the experts' bytes sharded like every other parameter),
a few SGD steps on this rank's half of the batch; rank 0 saves the losses (averaged over the ranks) and the trained
adapters, gathered. Run without torchrun (one process, the whole batch) it computes the reference.

    python -m torch.distributed.run --nproc_per_node 2 fsdp2_lora_worker.py FOLDER OUT.pt
"""

import os
import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import fully_shard

from kimi_hf import KimiK3ForConditionalGeneration
from kimi_hf.models.kimi_k3.modeling_kimi_k3 import K3_LORA_TARGET_MODULES


STEPS = 3


def batch() -> torch.Tensor:
    return torch.randint(3, 97, (4, 16), generator=torch.Generator().manual_seed(7))


def main(folder: str, out: str):
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = KimiK3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    assert model.experts_format == "mxfp4"
    model.config.text_config.use_cache = False
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=K3_LORA_TARGET_MODULES)
    model = get_peft_model(model, config).train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if distributed:
        for layer in model.base_model.model.model.language_model.layers:
            fully_shard(layer)
        fully_shard(model)
    # SGD: the update is the averaged gradient itself (Adam would blow rounding-level differences of near-zero
    # gradients up to the learning rate)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    x = batch()[rank::world]
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if distributed:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    params = dict(model.named_parameters())
    full = {n: (params[n].full_tensor() if distributed else params[n]).detach().clone() for n in names}
    experts = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    if rank == 0:
        local = experts[0].to_local() if distributed else experts[0]
        torch.save({"losses": losses, "adapters": full, "local_experts": tuple(local.shape)}, out)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
