"""kimi_hf.distributed.ParallelDims: the one layout of the package (the trainer's flags, the planner's layouts), the
sizes it fills in, the rules checked before any model is built, the fix a refusal names, the batch over the ranks."""

from __future__ import annotations

import copy

import pytest

from kimi_hf.distributed import ParallelDims


@pytest.fixture(scope="module")
def text_config():
    from kimi_hf.presets import small_k3_config

    config = small_k3_config(64, 4, vocab_size=100, media_token_id=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return config.get_text_config()  # 4 layers, 8 experts


@pytest.mark.parametrize(
    "sizes, world, filled, data, batches",
    [
        (dict(pp=2, fsdp=2), 4, dict(dp_replicate=1, fsdp=2), 2, 2),
        (dict(pp=2, ep=2), 4, dict(dp_replicate=1, fsdp=2), 2, 2),  # fsdp left out: the rest (torchtitan's -1)
        (dict(pp=2, ep=2, fsdp=-1), 4, dict(dp_replicate=1, fsdp=2), 2, 2),
        (dict(ep=8), 16, dict(dp_replicate=1, fsdp=16), 16, 16),  # --gpus 16 --ep 16 of the issue, at 8 experts
        (dict(pp=2, ep=2, cp=2), 4, dict(dp_replicate=1, fsdp=2), 2, 1),
        (dict(pp=2, tp=2, ep=2), 4, dict(dp_replicate=1, fsdp=1), 1, 1),
        (dict(tp=2, ep=2), 4, dict(dp_replicate=2, fsdp=1), 2, 2),  # under tp the rest replicates
        (dict(tp=2, ep=2, cp=2), 4, dict(dp_replicate=2, fsdp=1), 2, 1),
        (dict(pp=2, ep=2, fsdp=2), 8, dict(dp_replicate=2, fsdp=2), 4, 4),  # 2 replicas of each stage's 2 x 2
        (dict(fsdp=2, dp_replicate=2), 4, dict(dp_replicate=2, fsdp=2), 4, 4),
    ],
)
def test_supported_layouts_and_the_sizes_filled_in(text_config, sizes, world, filled, data, batches):
    dims = ParallelDims.for_model(world, text_config, **sizes)
    assert {k: getattr(dims, k) for k in filled} == filled
    assert dims.pp * dims.dp_replicate * dims.fsdp * dims.tp == world  # the sizes multiply to the world
    assert dims.data_ranks == data and dims.batch_ranks == batches
    assert dims.check(text_config) == dims  # the filled-in layout passes as given
    again = ParallelDims.for_model(world, text_config, **{"tp": 1, "ep": 1, "pp": 1, "cp": 1} | _parse(dims.flags()))
    assert again == dims  # its flags give it back


def _parse(flags: list[str]) -> dict[str, int]:
    return {flags[i][2:]: int(flags[i + 1]) for i in range(0, len(flags), 2)}


def test_describe_multiplies_to_the_world(text_config):
    dims = ParallelDims.for_model(16, text_config, ep=8)
    assert dims.describe() == "pp 1 x dp_replicate 1 x fsdp 16 x tp 1 = 16 ranks; ep 8 (tiles tp x fsdp), cp 1"
    assert dims.flags() == ["--ep", "8"]  # fsdp is what the others leave: left out
    assert ParallelDims.for_model(4, text_config, fsdp=2).flags() == ["--fsdp", "2"]  # 2 replicas: said


@pytest.mark.parametrize(
    "sizes, world, message",
    [
        (dict(pp=2, tp=2), 8, "--pp 2 with --tp 2 on 8 ranks: tensor parallelism inside a pipeline stage"),
        (dict(tp=2, fsdp=2), 4, "--tp 2 with --fsdp 2"),
        (dict(pp=2, ep=2, fsdp=1), 4, "--ep 2 must be a multiple of --tp 1 and divide --tp x --fsdp (1)"),
        (dict(ep=3), 3, "--ep 3 does not divide num_experts (8)"),
        (dict(pp=5), 5, "--pp 5 leaves a pipeline stage without layers"),
        (dict(pp=2, fsdp=2, cp=4), 4, "--cp 4 does not divide the 2 data ranks"),
        (dict(pp=3), 4, "--pp 3 x --tp 1 = 3 does not divide the world size 4"),
        (dict(fsdp=3), 4, "--fsdp 3 does not divide the 4 data ranks"),
        (dict(fsdp=2, dp_replicate=1), 4, "--dp-replicate 1 x --fsdp 2 = 2, but the world size 4 leaves 4 data ranks"),
        (dict(cp=0), 1, "--cp must be a positive integer, got 0"),
    ],
)
def test_refused_layouts_name_the_size(text_config, sizes, world, message):
    with pytest.raises(ValueError) as info:
        ParallelDims.for_model(world, text_config, **sizes)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "sizes, world, fix",
    [
        (dict(pp=2, ep=2, fsdp=1), 4, "; add --fsdp 2"),  # a size given as 1 first
        (dict(pp=2, fsdp=2, cp=4), 4, "; use --cp 2"),  # another size of one given
        (dict(pp=3), 4, "; use --pp 2"),
        (dict(pp=2, tp=2), 8, "; use --pp 4"),
        (dict(fsdp=2), 1, "; drop --fsdp 2"),  # then one dropped
        (dict(tp=2, fsdp=2), 4, "; drop --fsdp 2"),
        (dict(ep=3), 4, "; use --ep 2"),
    ],
)
def test_refused_layouts_name_the_flag_that_fixes_them(text_config, sizes, world, fix):
    with pytest.raises(ValueError) as info:
        ParallelDims.for_model(world, text_config, **sizes)
    assert str(info.value).endswith(fix)
    verb, flag, size = fix.split()[-3:]
    fixed = {**sizes, flag[2:]: 1 if verb == "drop" else int(size)}
    ParallelDims.for_model(world, text_config, **fixed)  # runs


def test_no_fix_is_named_when_one_flag_cannot_make_it_run(text_config):
    with pytest.raises(ValueError) as info:
        ParallelDims.for_model(1, text_config, cp=0)
    assert str(info.value) == "--cp must be a positive integer, got 0"


def test_the_sequence_over_cp(text_config):
    ParallelDims.for_model(2, text_config, cp=2, seq_len=32)
    with pytest.raises(ValueError, match="--seq-len 33 is not divisible by --cp 2; use --seq-len 34"):
        ParallelDims.for_model(2, text_config, cp=2, seq_len=33)
    context = text_config.linear_conv_kernel_dim - 1
    with pytest.raises(ValueError, match=f"--seq-len {2 * context} or more"):
        ParallelDims.for_model(2, text_config, cp=2, seq_len=2)


def test_the_batch_over_the_data_ranks(text_config):
    dims = ParallelDims.for_model(4, text_config, pp=2, ep=2)
    dims.check_batch(4)
    with pytest.raises(
        ValueError, match="--micro-batches 3 is not divisible by the 2 data ranks; use --micro-batches 4"
    ):
        dims.check_batch(3)
    with pytest.raises(ValueError, match="fewer than the --pp 2 stages the 1F1B schedule needs"):
        dims.check_batch(2)
    dims.check_batch(2, schedule="gpipe")


def test_tp_keeps_whole_mx_blocks_of_experts_stored_in_mxfp4(text_config):
    """The rule reads the stored form (the config's quantization_config), whatever the model then holds in memory:
    the loader cuts MXFP4 experts by tp before it decodes them."""
    from kimi_hf.models.kimi_k3.configuration_kimi_k3 import K3_MXFP4_QUANTIZATION_CONFIG

    dense = copy.deepcopy(text_config)
    dense.moe_intermediate_size = 96  # 3 blocks of 32: 48 inputs a rank at tp 2
    ParallelDims.for_model(2, dense, tp=2, ep=2)  # experts whole per rank (ep): fine
    ParallelDims.for_model(2, dense, tp=2)  # stored dense: any cut
    stored = copy.deepcopy(dense)
    stored.experts_quantization_config = dict(K3_MXFP4_QUANTIZATION_CONFIG)
    with pytest.raises(ValueError, match=r"--tp 2 splits the MXFP4 experts' moe_intermediate_size \(96\)"):
        ParallelDims.for_model(2, stored, tp=2)
    ParallelDims.for_model(2, stored, tp=2, ep=2)


def test_the_planner_and_the_loader_split_the_layers_alike():
    """K3's 93 layers (no pp divides them evenly but 3 and 31): the planner's stage of each layer is the stage
    loader's (`PipelineStageInfo.split`)."""
    from kimi_hf.models.kimi_hybrid.pipeline_kimi_hybrid import PipelineStageInfo, stage_layer_ranges
    from kimi_hf.plan.planner import _stage

    for layers, pp in ((93, 8), (93, 4), (7, 3), (4, 4)):
        split = stage_layer_ranges(layers, pp)
        for index in range(pp):
            for layer in PipelineStageInfo.split(layers, index, pp).layers:
                assert _stage(layer, False, split) == index
