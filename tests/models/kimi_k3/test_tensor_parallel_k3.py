"""Tensor and expert parallelism of Kimi K3's *released layout* (docs/parallelism.md), on CPU.

One `torchrun --nproc_per_node 2` run (gloo, the hybrid model's tp_worker.py) loads a tiny random K3 folder as
Moonshot ships it (MXFP4 experts, A_log stored [head_dim] zero-padded, two shards, fp32) with
`from_pretrained(path, tp_plan="auto")` and `DistributedConfig(tp_size=2, ep_size=2)`: the test compares the logits
(text, packed documents, an image), greedy generation with the cache, loss and gradients with the same computation
in this process, checks each rank's shards (A_log: the rank's heads, not the stored tensor's halves) and that
`save_pretrained` under TP / EP writes the same released folder as one process. About 12 s on 2 cores.
"""

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

from kimi_hf import KimiK3Config, KimiK3ForConditionalGeneration
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridMLA
from kimi_hf.models.kimi_hybrid.parallel_kimi_hybrid import check_parallel_layout

from ..kimi_hybrid.test_tensor_parallel import ROOT, WORKER, assert_same_results, expected_shard, free_port
from ..kimi_hybrid.tp_worker import QK_CLIP_GAMMA, compute
from .release_format import tiny_k3_config, write_k3_checkpoint


HEADS = 4  # KDA and MLA heads (2 per rank), in A_log's 32 stored entries (head_dim)
# fp32, logits up to ~4.4 in magnitude: observed max |diff| 2.0e-5 (tp) / 1.6e-5 (ep) on logits, 1.2e-5 on gradients
ATOL = 1e-4


def k3_tp_config(**overrides) -> dict:
    """The tiny K3 release config with 4 heads of each kind and experts whose intermediate width (64) leaves each
    of two TP ranks whole 32-value MXFP4 scale blocks."""
    return tiny_k3_config(
        moe_intermediate_size=64,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        linear_attn_config={"num_heads": HEADS},
        **overrides,
    )


def k3_inputs(config: dict) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (2, 24), generator=g)
    media = config["media_placeholder_token_id"]
    grid = torch.tensor([[1, 4, 6]])  # 24 patches -> 6 image tokens after the 2x2 merge
    image_ids = torch.cat([torch.tensor([7, 8]), torch.full((6,), media), torch.tensor([9, 10, 11])])[None]
    return dict(
        ids=ids,
        packed_ids=ids[:1],
        packed_pos=torch.cat([torch.arange(10), torch.arange(14)])[None],
        prompt=torch.randint(3, 97, (1, 20), generator=g),
        new_tokens=6,
        image_ids=image_ids,
        pixel_values=torch.randn(24, 3, 14, 14, generator=g),
        image_grid_thw=grid,
    )


def read_folder(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(glob.glob(str(folder / "*.safetensors"))):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3_tp")
    config = k3_tp_config()
    write_k3_checkpoint(root / "k3", config, seed=0, mxfp4=True, shards=2, dtype="float32")
    inputs = k3_inputs(config)
    torch.save(inputs, root / "k3" / "inputs.pt")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    out = subprocess.run(
        [*cmd, str(WORKER), str(root), str(root / "k3")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    model = AutoModelForCausalLM.from_pretrained(root / "k3", dtype=torch.float32)
    assert isinstance(model, KimiK3ForConditionalGeneration)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    results = {"root": root, "state": state, "ref": compute(model, inputs), "model": model}
    model.save_pretrained(root / "k3-single-saved")
    for layout in ("tp", "ep", "pp"):
        for rank in (0, 1):
            results[layout, rank] = torch.load(root / f"k3-{layout}-rank{rank}.pt", weights_only=False)
    return results


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_matches_single_process(runs, layout):
    for rank in (0, 1):
        assert_same_results(runs[layout, rank], runs["ref"], ("logits", "packed", "scores", "images"), ATOL)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_each_rank_holds_its_heads_and_experts(runs, layout):
    """Every sharded parameter's local tensor is this rank's slice of the loaded model's; A_log, stored [32] with 4
    heads then zeros, gives rank 1 heads 2 and 3 (the stored tensor's second half would be padding)."""
    state = runs["state"]
    for rank in (0, 1):
        shards = runs[layout, rank]["shards"]
        a_logs = [n for n in shards if n.endswith("self_attn.A_log")]
        assert a_logs and all(shards[n]["local"].shape == (HEADS // 2,) for n in a_logs)
        for name in a_logs:
            assert torch.equal(shards[name]["local"], state[name][2 * rank : 2 * rank + 2])
            assert shards[name]["local"].count_nonzero() == 2  # real heads, not padding
        for name, shard in shards.items():
            assert torch.equal(shard["local"], expected_shard(state[name], shard["placements"], rank)), name
        experts = "model.language_model.layers.1.mlp.experts."
        local = shards[experts + "down_proj"]["local"].shape  # [E, latent, I]: TP splits I, EP the experts
        assert local == ((8, 64, 32) if layout == "tp" else (4, 64, 64))
        # the vision tower and the projector are replicated
        assert any(n.startswith("model.vision_tower.") for n in runs[layout, rank]["replicated"])
        assert not any(n.startswith(("model.vision_tower.", "model.mm_projector.")) for n in shards)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_save_pretrained_writes_the_released_layout_as_one_process_does(runs, layout):
    """The shards gathered and written in K3's names: A_log [head_dim] with its zeros, experts re-packed MXFP4,
    bit for bit the folder one process writes."""
    saved, single = read_folder(runs["root"] / f"k3-{layout}-saved"), read_folder(runs["root"] / "k3-single-saved")
    assert saved.keys() == single.keys()
    for name, tensor in single.items():
        assert torch.equal(saved[name], tensor), name
    a_log = saved["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (32,) and a_log[HEADS:].count_nonzero() == 0
    assert saved["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"].dtype == torch.uint8


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_qk_clip_on_sharded_mla_with_q_lora(runs, layout):
    """apply_qk_clip(gamma of all heads) on the sharded q_b_proj / kv_b_proj scales this rank's rows as one process
    scales those heads' rows."""
    model = KimiK3ForConditionalGeneration(runs["model"].config)
    model.load_state_dict(runs["state"])
    for m in model.modules():
        if isinstance(m, KimiHybridMLA):
            m.apply_qk_clip(QK_CLIP_GAMMA)
    params = dict(model.named_parameters())
    for rank in (0, 1):
        clipped = runs[layout, rank]["clipped"]
        assert clipped and all(name.endswith(("q_b_proj.weight", "kv_b_proj.weight")) for name in clipped)
        for name, local in clipped.items():
            assert torch.allclose(local, params[name].detach().chunk(2, 0)[rank], atol=1e-7), name


def test_pipeline_parallelism_is_refused_by_name(runs):
    for rank in (0, 1):
        assert "pipeline parallelism (pp_size > 1) of the multimodal model" in runs["pp", rank]["refused"]


def test_mxfp4_experts_whose_tp_slice_splits_a_scale_block_are_refused():
    """moe_intermediate_size 96 over 2 ranks is 48 input columns of w2 per rank: not whole 32-value blocks. Checked
    on the model before it is distributed; expert parallelism (whole experts) is fine."""
    model = KimiK3ForConditionalGeneration(KimiK3Config(**tiny_k3_config()))  # moe_intermediate_size 96
    with pytest.raises(ValueError, match="moe_intermediate_size 96 / tp_size 2"):
        KimiK3ForConditionalGeneration.maybe_distribute_model(model, DistributedConfig(tp_size=2), None)


def test_multimodal_layout_checks():
    """The text model's checks apply under the multimodal class too: heads divisible by tp_size."""
    model = KimiK3ForConditionalGeneration(KimiK3Config(**k3_tp_config()))
    text = model.config.text_config
    check_parallel_layout(text, model.tp_plan, DistributedConfig(tp_size=2), multimodal=True)
    with pytest.raises(ValueError, match="linear_num_heads"):
        check_parallel_layout(text, model.tp_plan, DistributedConfig(tp_size=3), multimodal=True)
    with pytest.raises(ValueError, match="of the multimodal model"):
        check_parallel_layout(text, model.tp_plan, DistributedConfig(pp_size=2), multimodal=True)
