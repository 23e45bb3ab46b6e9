"""Worker of test_tensor_parallel.py, run under `torchrun --nproc_per_node 2` (CPU, gloo).

    python -m torch.distributed.run --nproc_per_node 2 tp_worker.py OUT CASE_DIR[:EXPERTS_IMPL[:EXPERTS_FORMAT]] ...

(EXPERTS_FORMAT: Kimi K3's from_pretrained(experts_format=...), "mxfp4" keeping the routed experts as bytes.)

For each checkpoint folder (written by the test, with `inputs.pt`) and each of three layouts,

    tp: from_pretrained(path, tp_plan="auto")                                  (tensor parallelism)
    ep: from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, ep_size=2))
        (the experts whole, half of them per rank, the rest as in tp)
    pp: from_pretrained(path, distributed_config=DistributedConfig(pp_size=2))
        (transformers' naive pipeline: half of the layers per rank; inference only)

it computes what the test also computes in one process: the logits of a batch and of packed documents,
greedy generation with the cache (scores and tokens), the training loss and every parameter's gradient
(gathered; not for pp), with images when inputs.pt has pixel_values (Kimi K3: the vision tower replicated), and
records each DTensor parameter's local shard and placement; for tp and ep it records QK-Clip's max logits, saves
the model again (OUT/<case>-<layout>-saved) and applies QK-Clip to the sharded MLA weights. The model class is
AutoModelForCausalLM's for the folder (KimiHybridForCausalLM; a K3 folder in the released layout:
KimiK3ForConditionalGeneration).
Each rank writes OUT/<case>-<layout>-rank<r>.pt (a load that is refused: {"refused": message}).
"""

import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import kimi_hf  # noqa: F401  (registers the Auto classes)
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import (
    KimiHybridExperts,
    KimiHybridMLA,
    KimiHybridMoE,
    KimiHybridMxfp4Experts,
)
from kimi_hf.optim import QKClip


QK_CLIP_GAMMA = torch.tensor([0.5, 1.0, 0.25, 0.8])  # one per MLA head (4)


@contextlib.contextmanager
def frozen_resident_moe(model):
    """Routed experts kept in MXFP4 are frozen bytes: their MoE layers are frozen too while training runs (as PEFT
    would freeze them), and the gradients of everything else pass through the experts."""
    frozen = [
        m for m in model.modules() if isinstance(m, KimiHybridMoE) and isinstance(m.experts, KimiHybridMxfp4Experts)
    ]
    for m in frozen:
        m.requires_grad_(False)
    try:
        yield
    finally:
        for m in frozen:
            for p in m.parameters():
                p.requires_grad_(p.is_floating_point())


def compute(model, inputs: dict, backward: bool = True) -> dict:
    """What the test compares; the same function runs the single-process reference."""
    model.eval()
    with torch.no_grad():
        logits = model(inputs["ids"]).logits
        packed = model(inputs["packed_ids"], position_ids=inputs["packed_pos"]).logits
        gen = model.generate(
            inputs["prompt"],
            max_new_tokens=inputs["new_tokens"],
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
        result = {"logits": logits, "packed": packed, "tokens": gen.sequences, "scores": torch.stack(gen.scores)}
        if "pixel_values" in inputs:
            result["images"] = model(
                inputs["image_ids"], pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]
            ).logits
    if not backward:
        return result
    model.train()
    with frozen_resident_moe(model):
        loss = model(inputs["ids"], labels=inputs["ids"]).loss
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():  # the same order on every rank: full_tensor() is a collective
        if p.grad is not None:
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
    model.zero_grad(set_to_none=True)
    return {**result, "loss": loss.detach(), "grads": grads}


def record_max_logits(model, inputs: dict) -> list[torch.Tensor]:
    """QK-Clip's per-head max logits of one training forward, all-reduced (tau high enough to clip nothing)."""
    clip = QKClip(model, tau=1e9)
    model.train()
    with frozen_resident_moe(model):
        model(inputs["ids"])
    assert clip.clip() == 0
    model.eval()
    return [m.clone() for m in clip.last_head_max]


def main(out: Path, cases: list[str]):
    for case in cases:
        path, _, impl = case.partition(":")
        impl, _, experts_format = impl.partition(":")
        fmt = {"experts_format": experts_format} if experts_format else {}
        inputs = torch.load(Path(path) / "inputs.pt")
        for layout in ("tp", "ep", "pp"):
            start = time.perf_counter()
            kw = {
                "tp": dict(tp_plan="auto"),
                "ep": dict(distributed_config=DistributedConfig(tp_size=2, ep_size=2)),
                "pp": dict(distributed_config=DistributedConfig(pp_size=2)),
            }[layout]
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    path, experts_implementation=impl or None, dtype=torch.float32, **fmt, **kw
                )
            except ValueError as e:  # pipeline parallelism with Attention Residuals: refused at load, on both ranks
                torch.save({"refused": str(e)}, out / f"{Path(path).name}-{layout}-rank{dist.get_rank()}.pt")
                continue
            result = compute(model, inputs, backward=layout != "pp")  # pp: inference only (the naive pipeline)
            result["shards"] = {
                name: {"local": p.to_local().detach().clone(), "placements": str(p.placements)}
                for name, p in model.named_parameters()
                if isinstance(p, DTensor)
            }
            result["replicated"] = {
                name: tuple(p.shape) for name, p in model.named_parameters() if not isinstance(p, DTensor)
            }
            result["local_experts"] = [
                m.num_experts for m in model.modules() if isinstance(m, (KimiHybridExperts, KimiHybridMxfp4Experts))
            ]
            result["experts_implementation"] = model.config._experts_implementation
            decoder = getattr(model.model, "language_model", model.model)
            result["layers"] = [type(layer).__name__ for layer in decoder.layers]
            if layout != "pp":
                result["qk_max"] = record_max_logits(model, inputs)  # each rank records its heads
                model.save_pretrained(out / f"{Path(path).name}-{layout}-saved")  # gathers the shards (all ranks)
                # QK-Clip with one factor per head of the model, on this rank's rows of the sharded weights
                result["clipped"] = {}
                for name, m in model.named_modules():
                    if isinstance(m, KimiHybridMLA):
                        m.apply_qk_clip(QK_CLIP_GAMMA)
                        for proj in ("q_proj", "q_b_proj", "kv_b_proj"):
                            if hasattr(m, proj):
                                weight = getattr(m, proj).weight
                                result["clipped"][f"{name}.{proj}.weight"] = weight.to_local().detach().clone()
            rank = dist.get_rank()
            torch.save(result, out / f"{Path(path).name}-{layout}-rank{rank}.pt")
            if rank == 0:
                print(f"{Path(path).name} {layout}: {time.perf_counter() - start:.1f} s", flush=True)
            del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
