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


# the two in-memory forms of the routed experts: the folder's name -> experts_format
FORMATS = {"k3": "dense", "k3mx": "mxfp4"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One torchrun of both forms (the same files: seed 0), and the single-process reference of each."""
    root = tmp_path_factory.mktemp("k3_tp")
    config = k3_tp_config()
    inputs = k3_inputs(config)
    for name in FORMATS:
        write_k3_checkpoint(root / name, config, seed=0, mxfp4=True, shards=2, dtype="float32")
        torch.save(inputs, root / name / "inputs.pt")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cases = [f"{root / name}::{fmt}" for name, fmt in FORMATS.items()]
    out = subprocess.run(
        [*cmd, str(WORKER), str(root), *cases], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    results = {"root": root}
    for name, fmt in FORMATS.items():
        model = AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32, experts_format=fmt)
        assert isinstance(model, KimiK3ForConditionalGeneration) and model.experts_format == fmt
        results[fmt] = {"state": {k: v.clone() for k, v in model.state_dict().items()}, "model": model}
        results[fmt]["ref"] = compute(model, inputs)
        model.save_pretrained(root / f"{name}-single-saved")
        for layout in ("tp", "ep", "pp"):
            for rank in (0, 1):
                results[fmt][layout, rank] = torch.load(root / f"{name}-{layout}-rank{rank}.pt", weights_only=False)
    return results


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_matches_single_process(runs, layout, fmt):
    """Logits, packed documents, greedy scores, images, loss and gradients (resident experts: of everything outside
    the frozen MoE layers, through the experts) equal one process."""
    run = runs[fmt]
    for rank in (0, 1):
        assert_same_results(run[layout, rank], run["ref"], ("logits", "packed", "scores", "images"), ATOL)
    # the resident model computes what the dense one does
    torch.testing.assert_close(run["ref"]["logits"], runs["dense"]["ref"]["logits"], rtol=0, atol=ATOL)


# the local shape of layer 1's experts on a rank: [E, latent, I] dense (TP splits I, EP the experts); resident:
# the packed bytes [E, latent, I / 2] and the scales [E, latent, I / 32] split the same way
LOCAL_EXPERTS = {
    ("dense", "tp"): {"down_proj": (8, 64, 32)},
    ("dense", "ep"): {"down_proj": (4, 64, 64)},
    ("mxfp4", "tp"): {"down_proj": (8, 64, 16), "down_proj_scale": (8, 64, 1), "gate_up_proj": (8, 64, 32)},
    ("mxfp4", "ep"): {"down_proj": (4, 64, 32), "down_proj_scale": (4, 64, 2), "gate_up_proj_scale": (4, 128, 2)},
}


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_each_rank_holds_its_heads_and_experts(runs, layout, fmt):
    """Every sharded parameter's local tensor is this rank's slice of the loaded model's; A_log, stored [32] with 4
    heads then zeros, gives rank 1 heads 2 and 3 (the stored tensor's second half would be padding)."""
    state = runs[fmt]["state"]
    for rank in (0, 1):
        shards = runs[fmt][layout, rank]["shards"]
        a_logs = [n for n in shards if n.endswith("self_attn.A_log")]
        assert a_logs and all(shards[n]["local"].shape == (HEADS // 2,) for n in a_logs)
        for name in a_logs:
            assert torch.equal(shards[name]["local"], state[name][2 * rank : 2 * rank + 2])
            assert shards[name]["local"].count_nonzero() == 2  # real heads, not padding
        for name, shard in shards.items():
            assert torch.equal(shard["local"], expected_shard(state[name], shard["placements"], rank)), name
        experts = "model.language_model.layers.1.mlp.experts."
        for name, shape in LOCAL_EXPERTS[fmt, layout].items():
            assert shards[experts + name]["local"].shape == shape, name
        # the vision tower and the projector are replicated
        assert any(n.startswith("model.vision_tower.") for n in runs[fmt][layout, rank]["replicated"])
        assert not any(n.startswith(("model.vision_tower.", "model.mm_projector.")) for n in shards)


@pytest.mark.parametrize("fmt", ["dense", "mxfp4"])
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_save_pretrained_writes_the_released_layout_as_one_process_does(runs, layout, fmt):
    """The shards gathered and written in K3's names: A_log [head_dim] with its zeros, experts re-packed MXFP4 (or,
    resident, their bytes), bit for bit the folder one process writes (resident: the folder loaded)."""
    name = next(n for n, f in FORMATS.items() if f == fmt)
    root = runs["root"]
    saved, single = read_folder(root / f"{name}-{layout}-saved"), read_folder(root / f"{name}-single-saved")
    assert saved.keys() == single.keys() == read_folder(root / name).keys()
    source = read_folder(root / name)
    for key, tensor in single.items():
        assert torch.equal(saved[key], tensor), key
        # resident: the loaded bytes themselves (dense experts re-pack the same values, where a group's codes all
        # lie in [-3, 3] at a smaller scale byte: ops/mxfp4.quantize_mxfp4)
        assert fmt == "dense" or torch.equal(tensor, source[key]), key
    a_log = saved["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (32,) and a_log[HEADS:].count_nonzero() == 0
    assert saved["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"].dtype == torch.uint8


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_qk_clip_on_sharded_mla_with_q_lora(runs, layout):
    """apply_qk_clip(gamma of all heads) on the sharded q_b_proj / kv_b_proj scales this rank's rows as one process
    scales those heads' rows."""
    run = runs["dense"]
    model = KimiK3ForConditionalGeneration(run["model"].config)
    model.load_state_dict(run["state"])
    for m in model.modules():
        if isinstance(m, KimiHybridMLA):
            m.apply_qk_clip(QK_CLIP_GAMMA)
    params = dict(model.named_parameters())
    for rank in (0, 1):
        clipped = run[layout, rank]["clipped"]
        assert clipped and all(name.endswith(("q_b_proj.weight", "kv_b_proj.weight")) for name in clipped)
        for name, local in clipped.items():
            assert torch.allclose(local, params[name].detach().chunk(2, 0)[rank], atol=1e-7), name


def test_pipeline_parallelism_is_refused_by_name(runs):
    for fmt in FORMATS.values():
        for rank in (0, 1):
            assert "pipeline parallelism (pp_size > 1) of the multimodal model" in runs[fmt]["pp", rank]["refused"]


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


def test_fsdp_plan_is_one_unit_per_decoder_layer_with_the_tower_in_the_root():
    """transformers' FSDP2 at load (DistributedConfig(fsdp_size=...)) shards what `fsdp_plan` names: the decoder's
    layers one unit each (the embedding, the final norm), every rule naming a module; nothing of the vision tower, which
    stays in the root unit (its own units would all-gather only on ranks whose batch has an image, and the ranks'
    collectives would not match). The text-only class keeps transformers' default plan under `model.`."""
    from kimi_hf import KimiK3ForCausalLM

    with torch.device("meta"):
        model = KimiK3ForConditionalGeneration(KimiK3Config(**tiny_k3_config()))
        text = KimiK3ForCausalLM(KimiK3Config(**tiny_k3_config()).text_config)
    prefix = "model.language_model."
    assert model.fsdp_plan == {
        prefix + "embed_tokens": "free_full_weight",
        prefix + "layers.*": "free_full_weight",
        prefix + "norm": "keep_full_weight",
    }
    assert set(text.fsdp_plan) == {"model.embed_tokens", "model.layers.*", "model.norm"}
    for m in (model, text):
        names = {n for n, _ in m.named_modules()}
        for rule in m.fsdp_plan:
            assert rule.replace("*", "0") in names, rule
