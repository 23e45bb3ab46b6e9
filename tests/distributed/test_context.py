"""Context parallelism (kimi_hf.distributed.context) on 2 gloo ranks against one process: tiny Kimi K3 (safe-gate
KDA with its short convolutions, gated MLA, Block Attention Residuals) and Kimi Linear, whole rows and packed
documents crossing the rank boundary (inside a document and on a document start), sdpa and eager: the logits, the
loss, every gradient and the weights after a MuonClip step (QK-Clip clipping) equal one process's within 1e-5 (fp32).
What context parallelism cannot run is a ValueError before any layer runs."""

from __future__ import annotations

import pytest
import torch

from kimi_hf.distributed.context import enable_context_parallel
from kimi_hf.models.kimi_hybrid.context_kimi_hybrid import ContextParallelism
from kimi_hf.models.kimi_hybrid.pipeline_kimi_hybrid import decoder_of

from . import cp_worker
from .launch import ROOT, torchrun


ATOL = 1e-5


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    torchrun(ROOT / "tests" / "distributed" / "cp_worker.py", [str(out)], nproc=2)
    return out


@pytest.mark.parametrize("case", cp_worker.CASES, ids=lambda c: c.name)
def test_cp2_matches_one_process(cp_results, case):
    ref = cp_worker.reference(case)
    parts = [torch.load(cp_results / f"{case.name}.rank{r}.pt") for r in range(2)]
    for rank, part in enumerate(parts):
        torch.testing.assert_close(part["logits"], ref["logits"][rank], atol=ATOL, rtol=0, msg=f"{case.name} logits")
        assert part["loss"].item() == pytest.approx(ref["loss"].item(), abs=ATOL, rel=ATOL)
        assert set(part["grads"]) == set(ref["grads"]), case.name  # every trained parameter got a gradient
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(part["grads"][name], grad, atol=ATOL, rtol=0, msg=f"{case.name} {name}")
        for name, weight in ref["weights"].items():
            torch.testing.assert_close(part["weights"][name], weight, atol=ATOL, rtol=0, msg=f"{case.name} {name}")
    # the step moved the weights (the comparison is not of untouched copies)
    before = cp_worker.build(case).state_dict()
    assert any((ref["weights"][n] - before[n]).abs().max() > 1e-4 for n in ref["grads"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_mask": torch.tensor([[1] * 7 + [0]])}, "a padding attention_mask is not supported"),
        ({"past_key_values": "cache"}, "no past_key_values / cache"),
    ],
)
def test_refused_inputs_name_the_argument(kwargs, message):
    """Checked before any collective runs (so here without a process group)."""
    from kimi_hf.models.kimi_hybrid.cache_kimi_hybrid import KimiHybridCache

    model = cp_worker.build(cp_worker.Case("x", "hybrid"))
    decoder_of(model)._context_parallel = ContextParallelism(None)
    if kwargs.get("past_key_values") == "cache":
        kwargs = {"past_key_values": KimiHybridCache(config=model.config)}
    with pytest.raises(ValueError, match=message):
        model(input_ids=torch.randint(3, 90, (1, 8)), **kwargs)


def test_short_slices_and_other_attention_are_refused():
    model = cp_worker.build(cp_worker.Case("x", "hybrid"))
    decoder_of(model)._context_parallel = ContextParallelism(None)
    width = model.config.linear_conv_kernel_dim - 1
    with pytest.raises(
        ValueError, match=f"slice holds {width - 1} tokens, fewer than the short convolution's left context"
    ):
        model(input_ids=torch.randint(3, 90, (1, width - 1)))
    # a kernel registered by the user (as flash / flex ones are): it would get this rank's queries and every key
    from transformers import AttentionInterface

    from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import eager_attention_forward

    AttentionInterface.register("user_kernel", eager_attention_forward)
    model.set_attn_implementation("user_kernel")
    with pytest.raises(ValueError, match="attn_implementation 'user_kernel' is not supported"):
        model(input_ids=torch.randint(3, 90, (1, 8)))
    with pytest.raises(ValueError, match="enable_context_parallel: attn_implementation 'user_kernel'"):
        enable_context_parallel(model, None)
    with pytest.raises(TypeError, match="not a kimi_hf hybrid model"):
        enable_context_parallel(torch.nn.Linear(2, 2), None)


def test_cp2_x_fsdp2_x_ep2_gradients_match_one_process(tmp_path):
    """4 ranks: transformers shards a released-layout K3 folder (FSDP2 x EP 2, whole experts over the ep ranks) and
    each of the two sequences is split over a context-parallel pair of data ranks: the loss and every gradient
    (gathered from the DTensors) are one process's. fp32 rounding: the largest difference, 1.2e-5 on a gradient whose
    largest element is 1.05 (layer 0's k_proj, at the end of the backward), is the same without FSDP2 / EP (CP 2 alone)
    and vanishes in fp64 (3e-16, by hand: FSDP2 refuses fp64 beside the fp32-kept tensors), so the bound is 2e-5
    absolute plus 1e-5 relative. The vision tower gets exact zeros in one process and no gradient here."""
    from tests.models.kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint

    from . import cp_ep_worker

    folder, out = tmp_path / "k3", tmp_path / "grads.pt"
    write_k3_checkpoint(folder, tiny_k3_config(), seed=0, mxfp4=True, shards=3, dtype="float32")
    torchrun(ROOT / "tests" / "distributed" / "cp_ep_worker.py", [str(folder), str(out)], nproc=4)
    got, ref = torch.load(out), cp_ep_worker.reference(str(folder))
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert set(got["grads"]) <= set(ref["grads"])
    for name, grad in ref["grads"].items():
        if name not in got["grads"]:
            assert "vision" in name or "projector" in name, name
            assert not grad.any(), name
            continue
        torch.testing.assert_close(got["grads"][name], grad, atol=2 * ATOL, rtol=ATOL, msg=name)
    experts = [n for n in got["grads"] if "experts.gate_up_proj" in n]
    assert experts and all(got["grads"][n].abs().max() > 0 for n in experts)  # the experts' gradients came back
