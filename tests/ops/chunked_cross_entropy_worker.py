"""Worker of test_chunked_cross_entropy_tp.py, run under `torchrun --nproc_per_node 2` (CPU, gloo):

    python -m torch.distributed.run --nproc_per_node 2 chunked_cross_entropy_worker.py OUT MODEL_DIR

- op: linear_cross_entropy with the head weight a DTensor sharded by vocabulary rows over the 2 ranks (an odd
  vocabulary: 27 and 26 rows), the hidden states replicated; its loss, d hidden and the gathered d weight;
- tp: the tiny Kimi Linear folder MODEL_DIR loaded with `tp_plan="auto"` (lm_head `colwise_gather_output`), the
  training loss and every parameter's gathered gradient, plain and with loss_chunk_size (vocabulary-parallel);
- pp: the same model in a 2-stage pipeline (1F1B, 4 micro-batches) whose last stage returns hidden states and whose
  loss function holds the head (CausalLMLoss(head=, chunk_size=)): the summed micro-batch losses and the gradients.
Each rank writes OUT/<part>-rank<r>.pt; the test compares them with one process.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from transformers import AutoModelForCausalLM

import kimi_hf  # noqa: F401  (registers the Auto classes)
from kimi_hf.distributed import CausalLMLoss, KimiPipelineStageModule, PipelineStageInfo, build_schedule
from kimi_hf.distributed.pipeline import prune_to_stage
from kimi_hf.ops import linear_cross_entropy


CHUNK = 5
OP_SHAPES = dict(n=37, d=24, v=53)
PP_BATCH, PP_SEQ = 4, 16


def op_inputs():
    g = torch.Generator().manual_seed(0)
    n, d, v = OP_SHAPES["n"], OP_SHAPES["d"], OP_SHAPES["v"]
    hidden = torch.randn(n, d, generator=g)
    weight = 0.3 * torch.randn(v, d, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::5] = -100
    return hidden, weight, targets


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_op(mesh) -> dict:
    hidden, weight, targets = op_inputs()
    hidden.requires_grad_()
    sharded = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    loss = linear_cross_entropy(hidden, sharded, targets, chunk_size=CHUNK)
    loss.backward()
    return {"loss": loss.detach(), "hidden": hidden.grad.clone(), "weight": full(sharded.grad)}


def loss_and_grads(model, ids) -> dict:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}  # a collective: same order
    return {"loss": out.loss.detach(), "grads": grads, "logits": out.logits is None}


def run_tp(folder: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32).train()
    ids = torch.load(folder / "inputs.pt")["ids"]
    result = {"head_placements": str(model.lm_head.weight.placements), "plain": loss_and_grads(model, ids)}
    model.config.loss_chunk_size = CHUNK
    result["chunked"] = loss_and_grads(model, ids)
    return result


def run_pp(folder: Path, rank: int, world: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    text = model.config.get_text_config()
    text.loss_chunk_size = CHUNK
    stage = PipelineStageInfo.split(text.num_hidden_layers, rank, world)
    prune_to_stage(model, stage)
    module = KimiPipelineStageModule(model, stage)
    loss_fn = CausalLMLoss(text.vocab_size, head=model.lm_head, chunk_size=text.loss_chunk_size)
    ids = torch.load(folder / "inputs.pt")["pp_ids"]
    loss_fn.num_items = ids[:, 1:].numel()
    schedule = build_schedule(
        module, stage, dist.group.WORLD, PP_BATCH, loss_fn, "1f1b", micro_batch=1, seq_len=PP_SEQ
    )
    losses = []
    if stage.is_first:
        schedule.step(ids)
    else:
        schedule.step(target=ids, losses=losses)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": torch.stack(losses).sum().detach() if losses else None, "grads": grads}


def main(out: Path, folder: Path):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.save(run_op(mesh), out / f"op-rank{rank}.pt")
    torch.save(run_tp(folder), out / f"tp-rank{rank}.pt")
    torch.save(run_pp(folder, rank, world), out / f"pp-rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
