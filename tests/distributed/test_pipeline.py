"""Pipeline parallelism (kimi_hf.distributed.pipeline) on gloo ranks against one process: tiny Kimi K3 (Block
Attention Residuals, the stage boundary inside a block and on a block edge) and Kimi Linear (with and without
AttnRes), GPipe and 1F1B, MuonClip and AdamW, PP 2, PP 2 x FSDP2 2 and PP 2 x FSDP2 2 x EP 2; a stage loaded from a
folder in the released K3 layout holds exactly its part."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
import torch

from kimi_hf.distributed import PipelineStageInfo, build_schedule, load_pipeline_stage, stage_layer_ranges
from kimi_hf.distributed.pipeline import KimiPipelineStageModule, prune_to_stage, stage_io_meta

from . import pp_worker
from .launch import ROOT, torchrun


def _merged(out_dir: Path, case) -> tuple[dict, list]:
    parts = [torch.load(f) for f in sorted(glob.glob(str(out_dir / f"{case.name}.stage*.pt")))]
    assert len(parts) == 2, case.name
    merged = {"grads": {}, "weights": {}}
    for part in parts:
        for key in merged:
            assert not set(merged[key]) & set(part[key]), "two stages hold the same parameter"
            merged[key].update(part[key])
    return merged, parts


def _check(case, out_dir: Path, atol: float = 1e-5) -> None:
    ref = pp_worker.reference(case)
    merged, parts = _merged(out_dir, case)
    last = max(parts, key=lambda p: p["stage"])
    assert last["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-5), case.name
    assert set(merged["weights"]) == set(ref["weights"]), case.name  # every parameter on exactly one stage
    assert set(merged["grads"]) == set(ref["grads"]), case.name
    for name, g in ref["grads"].items():
        torch.testing.assert_close(merged["grads"][name], g, atol=atol, rtol=1e-4, msg=f"{case.name}: grad {name}")
    for name, w in ref["weights"].items():
        if case.optimizer != "adamw":
            torch.testing.assert_close(merged["weights"][name], w, atol=atol, rtol=1e-4, msg=f"{case.name}: {name}")
            continue
        # Adam divides by the gradient's own size: an element whose gradient is rounding noise (1e-8 here, the step-1
        # gradients above agree to that) moves by up to lr = 1e-3 a step either way, in any correct layout. Every
        # other element must agree; a real fault (a missing reduction, a wrong divisor) moves most of them.
        diff = (merged["weights"][name] - w).abs()
        off = diff > atol + 1e-4 * w.abs()
        assert off.float().mean().item() <= 1e-3 and diff.max().item() <= 2 * 1e-3, (
            f"{case.name}: {name}: {int(off.sum())} of {w.numel()} elements off, max {diff.max().item():.2e}"
        )
    if ref["clipped"] is not None:  # QK-Clip ran on the stage holding the MLA layers, as in one process
        assert ref["clipped"] > 0
        assert sum(p["clipped"] for p in parts) == ref["clipped"], case.name


def test_pp2_matches_one_process(tmp_path):
    """PP 2 (one sequence a micro-batch, 4 of them): the cases of pp_worker.CASES, interleaved stages (4 stages on
    the 2 ranks) included; losses, every gradient of the first step and the weights after two steps within 1e-5
    (fp32) of one process training on the whole batch."""
    torchrun(ROOT / "tests" / "distributed" / "pp_worker.py", [str(tmp_path)], nproc=2)
    for case in pp_worker.CASES:
        _check(case, tmp_path)


def test_pp2_x_fsdp2_matches_one_process(tmp_path):
    """4 ranks: 2 stages, each fully sharded (FSDP2) over 2 data ranks that see half of the batch."""
    torchrun(ROOT / "tests" / "distributed" / "pp_worker.py", [str(tmp_path), "--fsdp", "2"], nproc=4)
    for case in pp_worker.FSDP_CASES:
        _check(case, tmp_path)


def test_pp2_x_fsdp2_x_ep2_matches_one_process(tmp_path):
    """4 ranks: 2 stages, each loaded from a saved folder by load_pipeline_stage with transformers' expert
    parallelism over its 2 data ranks (4 of the 8 / 2 of the 4 experts a rank, tokens exchanged all-to-all) and
    fully sharded (shard_stage: the experts' gradients divided by the data ranks as transformers' FSDP2 does); in the
    cases with cp 2 the 2 data ranks also split each sequence (context parallelism inside the stages)."""
    torchrun(ROOT / "tests" / "distributed" / "pp_worker.py", [str(tmp_path), "--fsdp", "2", "--ep", "2"], nproc=4)
    for case in pp_worker.EP_CASES:
        _check(case, tmp_path)
        total = pp_worker.build(case.arch).config.get_text_config().num_experts
        parts = _merged(tmp_path, case)[1]
        held = [p["local_experts"] for p in parts]  # (K3's first layer is dense: a stage of it alone holds none)
        assert [total // 2] in held and all(h in ([], [total // 2]) for h in held), (case.name, held)


# ---- one process: the split, the boundary shapes, bad input ------------------------------------------------------
def test_stage_layer_ranges():
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layer_ranges(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError, match="pp 5 leaves a pipeline stage without layers"):
        stage_layer_ranges(4, 5)
    with pytest.raises(ValueError, match="layers_per_stage"):
        stage_layer_ranges(4, 2, [4, 0])
    with pytest.raises(ValueError, match="pipeline stage index 2"):
        PipelineStageInfo.split(4, 2, 2)


@pytest.mark.parametrize("arch", ["k3", "hybrid", "hybrid_block"])
def test_stage_io_meta_is_what_the_stages_pass(arch):
    """The shapes given to torch's PipelineStage (so that it runs no inference forward) are those the stages'
    forwards produce, at every boundary of a 4-stage split; chaining the stages gives one process's logits."""
    model = pp_worker.build(arch).eval()
    x = pp_worker.batch(0)[:2]
    with torch.no_grad():
        expected = model(input_ids=x, use_cache=False).logits
        inputs = (x,)
        for index in range(4):
            stage = PipelineStageInfo.split(4, index, 4)
            meta_in, meta_out = stage_io_meta(model, stage, *x.shape)
            assert [(t.shape, t.dtype) for t in meta_in] == [(t.shape, t.dtype) for t in inputs]
            out = KimiPipelineStageModule(model, stage)(*inputs)
            inputs = out if isinstance(out, tuple) else (out,)
            assert [(t.shape, t.dtype) for t in meta_out] == [(t.shape, t.dtype) for t in inputs]
    torch.testing.assert_close(inputs[0], expected, atol=1e-5, rtol=1e-5)


def test_bad_pipeline_inputs():
    from kimi_hf import KimiHybridForCausalLM
    from tests.models.kimi_hybrid.helpers import tiny_config

    tied = KimiHybridForCausalLM(tiny_config(tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        prune_to_stage(tied, PipelineStageInfo.split(4, 0, 2))
    model = pp_worker.build("hybrid")
    stage = PipelineStageInfo.split(4, 0, 2)
    with pytest.raises(ValueError, match="pipeline split is for 6 layers"):
        prune_to_stage(model, PipelineStageInfo.split(6, 0, 2))
    with pytest.raises(ValueError, match="1F1B schedule needs at least as many micro-batches as stages"):
        build_schedule(model, stage, None, 1, None, "1f1b", micro_batch=1, seq_len=8)
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_schedule(model, stage, None, 2, None, "zb", micro_batch=1, seq_len=8)
    # interleaved: rank 0 of 2 holds stages 0 and 2 of 4
    stages = PipelineStageInfo.interleaved(4, 0, 2, 2)
    assert [(s.index, s.num_stages, list(s.layers)) for s in stages] == [(0, 4, [0]), (2, 4, [2])]
    with pytest.raises(ValueError, match="interleaved_1f1b schedule takes the tuple"):
        build_schedule(model, stages, None, 2, None, "1f1b", micro_batch=1, seq_len=8)
    with pytest.raises(ValueError, match="interleaved_1f1b schedule takes the tuple"):
        build_schedule(model, stage, None, 2, None, "interleaved_1f1b", micro_batch=1, seq_len=8)
    with pytest.raises(ValueError, match="micro-batches in multiples of pp: n_microbatches 3, pp 2"):
        build_schedule(model, stages, None, 3, None, "interleaved_1f1b", micro_batch=1, seq_len=8)
    with pytest.raises(ValueError, match="pipeline rank 2 is not in"):
        PipelineStageInfo.interleaved(4, 2, 2, 2)
    with pytest.raises(ValueError, match="leaves a pipeline stage without layers"):
        PipelineStageInfo.interleaved(4, 0, 2, 3)
    with pytest.raises(ValueError, match="distinct stages of one split"):
        prune_to_stage(pp_worker.build("hybrid"), (stage, stage))


def test_bad_stage_distributed_config(tmp_path):
    """load_pipeline_stage's distributed_config is checked before anything is read (tmp_path holds no model)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    stage = PipelineStageInfo.split(4, 0, 2)
    with pytest.raises(TypeError, match="distributed_config must be a transformers DistributedConfig, got dict"):
        load_pipeline_stage(AutoModelForCausalLM, tmp_path, stage, distributed_config={"ep_size": 2})
    with pytest.raises(ValueError, match="tp_size 2 with fsdp_size x dp_replicate_size 2"):
        load_pipeline_stage(
            AutoModelForCausalLM, tmp_path, stage, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2)
        )
    with pytest.raises(ValueError, match="with neither ep_size nor tp_size > 1"):
        load_pipeline_stage(AutoModelForCausalLM, tmp_path, stage, distributed_config=DistributedConfig(fsdp_size=2))
    with pytest.raises(ValueError, match="tp_plan"):
        load_pipeline_stage(AutoModelForCausalLM, tmp_path, stage, tp_plan="auto")
    with pytest.raises(ValueError, match="distributed_config with interleaved stages"):
        load_pipeline_stage(
            AutoModelForCausalLM,
            tmp_path,
            PipelineStageInfo.interleaved(4, 0, 2, 2),
            distributed_config=DistributedConfig(ep_size=2, fsdp_size=2),
        )


def test_load_pipeline_stage_of_a_released_k3_folder(tmp_path):
    """A stage loaded from the released layout (MXFP4 experts kept resident) holds its layers (the same tensors as
    a whole load) and placeholders for the rest; the other stages' checkpoint tensors are not reported."""
    from transformers import AutoModelForImageTextToText

    from tests.models.kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint

    config = tiny_k3_config()
    write_k3_checkpoint(tmp_path, config, seed=0, mxfp4=True, shards=3, dtype="float32")
    whole = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    layers = config["text_config"]["num_hidden_layers"]
    full = dict(whole.named_parameters())
    # two stages, and rank 1's two stages of an interleaved split into 4 (layers 2, 3 and 6 of 7: not contiguous)
    for stage in (
        *(PipelineStageInfo.split(layers, i, 2) for i in range(2)),
        PipelineStageInfo.interleaved(layers, 1, 2, 2),
    ):
        stages = stage if isinstance(stage, tuple) else (stage,)
        part, info = load_pipeline_stage(
            AutoModelForImageTextToText, tmp_path, stage, dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        assert part.experts_format == "mxfp4"
        names = dict(part.named_parameters())
        prefix = "model.language_model.layers."
        held = {int(n[len(prefix) :].split(".")[0]) for n in names if n.startswith(prefix)}
        assert held == {i for s in stages for i in s.layers}
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        assert ("lm_head.weight" in names) == last
        assert ("model.language_model.embed_tokens.weight" in names) == first
        assert any(n.startswith("model.vision_tower.") for n in names) == first
        for name, p in names.items():
            torch.testing.assert_close(p, full[name], atol=0, rtol=0, msg=name)
