"""kimi_hf.distributed.mesh.TrainingLayout: the checks made before any model is built (a layout of the example's flags on a
world size), and the data ranks each layout leaves."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kimi_hf.distributed.mesh import TrainingLayout


@pytest.fixture(scope="module")
def text_config():
    from kimi_hf.presets import small_k3_config

    config = small_k3_config(64, 4, vocab_size=100, media_token_id=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return config.get_text_config()  # 4 layers, 8 experts


@pytest.mark.parametrize(
    "layout, world, data, batches",
    [
        (TrainingLayout(pp=2, fsdp=2), 4, 2, 2),
        (TrainingLayout(pp=2, ep=2, fsdp=2), 4, 2, 2),
        (TrainingLayout(pp=2, ep=2, fsdp=2, cp=2), 4, 2, 1),
        (TrainingLayout(pp=2, tp=2, ep=2), 4, 1, 1),
        (TrainingLayout(tp=2, ep=2, cp=2), 4, 2, 1),
        (TrainingLayout(pp=2, ep=2, fsdp=2), 8, 4, 4),  # 2 replicas of each stage's 2 x 2
    ],
)
def test_supported_layouts(text_config, layout, world, data, batches):
    layout.check(world, text_config)
    assert layout.data_ranks(world) == data and layout.batch_ranks(world) == batches


@pytest.mark.parametrize(
    "layout, world, message",
    [
        (TrainingLayout(pp=2, tp=2), 8, "--pp 2 with --tp 2 on 8 ranks: tensor parallelism inside a pipeline stage"),
        (TrainingLayout(tp=2, fsdp=2), 4, "--tp 2 with --fsdp 2"),
        (TrainingLayout(pp=2, ep=2), 4, "--ep 2 must be a multiple of --tp 1 and divide --tp x --fsdp (1)"),
        (TrainingLayout(ep=3, fsdp=3), 3, "--ep 3 does not divide num_experts (8)"),
        (TrainingLayout(pp=5), 5, "--pp 5 leaves a pipeline stage without layers"),
        (TrainingLayout(pp=2, fsdp=2, cp=4), 4, "--cp 4 does not divide the 2 data ranks"),
        (TrainingLayout(pp=3), 4, "does not divide the world size 4"),
        (TrainingLayout(cp=0), 1, "--cp must be a positive integer, got 0"),
    ],
)
def test_refused_layouts_name_the_size(text_config, layout, world, message):
    with pytest.raises(ValueError) as info:
        layout.check(world, text_config)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "layout, world, fix",
    [
        (TrainingLayout(pp=2, ep=2), 4, "; add --fsdp 2"),  # a flag left out first
        (TrainingLayout(ep=2), 2, "; add --fsdp 2"),
        (TrainingLayout(pp=2, fsdp=2, cp=4), 4, "; use --cp 2"),  # then another size of one given
        (TrainingLayout(pp=3), 4, "; use --pp 2"),
        (TrainingLayout(pp=2, tp=2), 8, "; use --pp 4"),
        (TrainingLayout(fsdp=2), 1, "; drop --fsdp 2"),  # then one dropped
        (TrainingLayout(tp=2, fsdp=2), 4, "; drop --fsdp 2"),
    ],
)
def test_refused_layouts_name_the_flag_that_fixes_them(text_config, layout, world, fix):
    with pytest.raises(ValueError) as info:
        layout.check(world, text_config)
    assert str(info.value).endswith(fix)
    flag, size = fix.split()[-2:]
    replace(layout, **{flag[2:]: 1 if fix.startswith("; drop") else int(size)}).check(world, text_config)  # runs


def test_no_fix_is_named_when_one_flag_cannot_make_it_run(text_config):
    with pytest.raises(ValueError) as info:
        TrainingLayout(cp=0).check(1, text_config)
    assert str(info.value) == "--cp must be a positive integer, got 0"


def test_tp_keeps_whole_mx_blocks_of_experts_stored_in_mxfp4(text_config):
    """The rule reads the stored form (the config's quantization_config), whatever the model then holds in memory:
    the loader cuts MXFP4 experts by tp before it decodes them."""
    import copy

    from kimi_hf.models.kimi_k3.configuration_kimi_k3 import K3_MXFP4_QUANTIZATION_CONFIG

    dense = copy.deepcopy(text_config)
    dense.moe_intermediate_size = 96  # 3 blocks of 32: 48 inputs a rank at tp 2
    TrainingLayout(tp=2, ep=2).check(2, dense)  # experts whole per rank (ep): fine
    TrainingLayout(tp=2).check(2, dense)  # stored dense: any cut
    stored = copy.deepcopy(dense)
    stored.experts_quantization_config = dict(K3_MXFP4_QUANTIZATION_CONFIG)
    with pytest.raises(ValueError, match=r"--tp 2 splits the MXFP4 experts' moe_intermediate_size \(96\)"):
        TrainingLayout(tp=2).check(2, stored)
    TrainingLayout(tp=2, ep=2).check(2, stored)
