"""The chunked head + loss on 2 gloo ranks (chunked_cross_entropy_worker.py under torchrun) against one process, fp32:

- vocabulary-parallel linear_cross_entropy (the head's rows sharded over the ranks, 27 / 26 of an odd vocabulary):
  loss, d hidden and d weight against the fp64 log_softmax reference, within 1e-6 of the largest magnitude (measured:
  3e-8 loss, 1.4e-7 gradients);
- a tiny Kimi Linear (vocabulary 97: 49 / 48 rows) loaded with tp_plan="auto" (lm_head colwise_gather_output)
  training with loss_chunk_size: its loss and every parameter's gathered gradient against one process's plain loss
  (measured: loss 1e-7 relative; lm_head 6.4e-7 and any parameter at most 3.3e-6 of its largest gradient, where the
  plain loss under TP itself is 4.5e-6 off: the TP layers sum in another order), allowed 1e-5;
- a 2-stage pipeline (1F1B, 4 micro-batches) whose last stage returns hidden states and whose loss function holds the
  head (CausalLMLoss(head=, chunk_size=)): the step's loss and every gradient against one process (measured: 1e-7
  loss, 1e-6 gradients; allowed 1e-5).
About 40 s on 2 shared cores (one torchrun of 2 ranks)."""

from __future__ import annotations

import pytest
import torch

from kimi_hf import KimiHybridForCausalLM

from ..distributed.launch import ROOT, torchrun
from ..models.kimi_hybrid.helpers import tiny_config
from . import chunked_cross_entropy_worker as worker
from .test_chunked_cross_entropy import close, reference


HEADS = 4  # KDA and MLA heads: 2 per rank
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked_ce")
    folder = root / "model"
    torch.manual_seed(0)
    config = tiny_config(linear_num_heads=HEADS, num_attention_heads=HEADS, attn_implementation="eager")
    KimiHybridForCausalLM(config).save_pretrained(folder)
    g = torch.Generator().manual_seed(1)
    torch.save(
        dict(
            ids=torch.randint(3, 97, (2, 24), generator=g),
            pp_ids=torch.randint(3, 97, (worker.PP_BATCH, worker.PP_SEQ), generator=g),
        ),
        folder / "inputs.pt",
    )
    torchrun(ROOT / "tests" / "ops" / "chunked_cross_entropy_worker.py", [str(root), str(folder)], nproc=2)
    load = lambda part, rank: torch.load(root / f"{part}-rank{rank}.pt", weights_only=False)  # noqa: E731
    return {"folder": folder, **{(part, r): load(part, r) for part in ("op", "tp", "pp") for r in (0, 1)}}


def plain_reference(folder, ids) -> tuple[torch.Tensor, dict]:
    model = KimiHybridForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads(actual: dict, expected: dict, where: str):
    assert actual.keys() == expected.keys(), where
    for name, g in expected.items():
        err = ((actual[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        assert err <= TOL, (where, name, err)


def test_vocabulary_parallel_op_matches_fp64(runs):
    hidden, weight, targets = worker.op_inputs()
    total, count, dh, dw = reference(hidden, weight, targets)
    for rank in (0, 1):
        result = runs["op", rank]
        close(result["loss"], total / count)
        close(result["hidden"], dh / count)
        close(result["weight"], dw / count)


def test_tensor_parallel_model_trains_the_same_with_the_chunked_loss(runs):
    ids = torch.load(runs["folder"] / "inputs.pt")["ids"]
    loss, grads = plain_reference(runs["folder"], ids)
    for rank in (0, 1):
        result = runs["tp", rank]
        assert result["head_placements"] == "(Shard(dim=0),)"  # the head's rows sharded: vocabulary-parallel
        for mode in ("plain", "chunked"):
            assert result[mode]["loss"].item() == pytest.approx(loss.item(), rel=1e-6), (rank, mode)
            assert_grads(result[mode]["grads"], grads, f"tp rank {rank} {mode}")
        assert result["chunked"]["logits"]  # no logits returned


def test_pipeline_last_stage_loss_holds_the_head(runs):
    ids = torch.load(runs["folder"] / "inputs.pt")["pp_ids"]
    loss, grads = plain_reference(runs["folder"], ids)
    first, last = runs["pp", 0], runs["pp", 1]
    assert first["loss"] is None and last["loss"].item() == pytest.approx(loss.item(), rel=1e-6)
    assert not set(first["grads"]) & set(last["grads"]) and "lm_head.weight" in last["grads"]
    assert_grads({**first["grads"], **last["grads"]}, grads, "pp")
