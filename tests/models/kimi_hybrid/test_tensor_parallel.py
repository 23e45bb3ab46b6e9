"""Tensor, expert and pipeline parallelism through transformers' plans (docs/parallelism.md), on CPU.

One `torchrun --nproc_per_node 2` run (gloo, tp_worker.py) loads each tiny checkpoint three ways:
`from_pretrained(path, tp_plan="auto")`, `DistributedConfig(tp_size=2, ep_size=2)` and
`DistributedConfig(pp_size=2)`; the tests compare what it computed (logits, packed documents, greedy
generation with the cache, loss and gradients) with the same computation in this process, and check
which parameters are sharded and how. About 20 s on 2 cores.

    plain            3 KDA + 1 MLA layers, q_proj (no q LoRA), grouped_mm experts
    lora_attnres     MLA / KDA alternating, q LoRA, block Attention Residuals, grouped router, eager experts
    plain-*-layout   plain in Moonshot's / transformers' in-memory Kimi-Linear layouts (load-time conversion)
    multimodal_tied  the multimodal model with tied embeddings, an image in its inputs
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridExperts, KimiHybridMLA
from kimi_hf.models.kimi_hybrid.parallel_kimi_hybrid import ATTN_RES_PP_PLAN, EP_PLAN, PP_PLAN, TP_PLAN

from .helpers import tiny_config
from .tp_worker import QK_CLIP_GAMMA, compute, record_max_logits


ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("tp_worker.py")
ATOL = 1e-5  # fp32: observed max |diff| about 4e-6 on logits, 2e-6 on gradients
HEADS = 4  # KDA and MLA heads: 2 per rank

CASES = {
    "plain": (dict(), None),
    "lora_attnres": (
        dict(
            q_lora_rank=8,
            attn_residual="block",
            n_group=2,
            topk_group=2,
            layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        ),
        "eager",
    ),
}


def case_config(name):
    return tiny_config(linear_num_heads=HEADS, num_attention_heads=HEADS, **CASES[name][0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: {"ref": single-process results, "state": the checkpoint's tensors, (layout, rank): worker results},
    "root": the folder of the checkpoints and of the worker's output}."""
    root = tmp_path_factory.mktemp("tp")
    args = []
    for name, (_, impl) in CASES.items():
        torch.manual_seed(0)
        KimiHybridForCausalLM(case_config(name)).save_pretrained(root / name)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 97, (2, 24), generator=g)
        # two packed documents in one row; a prompt longer than the absorbed-MLA threshold (16), so that decoding
        # runs the absorbed path on the local heads' slice of kv_b_proj
        torch.save(
            dict(
                ids=ids,
                packed_ids=ids[:1],
                packed_pos=torch.cat([torch.arange(10), torch.arange(14)])[None],
                prompt=torch.randint(3, 97, (1, 20), generator=g),
                new_tokens=6,
            ),
            root / name / "inputs.pt",
        )
        args.append(f"{root / name}:{impl}" if impl else str(root / name))
    for layout in OTHER_LAYOUTS:
        write_other_layout(root / "plain", root / f"plain-{layout}-layout", layout)
        args.append(str(root / f"plain-{layout}-layout"))
    args.append(str(write_tied_multimodal(root / MULTIMODAL)))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(WORKER),
        str(root),
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    results = {"root": root}
    model = AutoModelForCausalLM.from_pretrained(root / MULTIMODAL)
    results[MULTIMODAL] = {"ref": compute(model, torch.load(root / MULTIMODAL / "inputs.pt"))}
    for layout in ("tp", "ep"):
        for rank in (0, 1):
            results[MULTIMODAL][layout, rank] = torch.load(
                root / f"{MULTIMODAL}-{layout}-rank{rank}.pt", weights_only=False
            )
    for other in OTHER_LAYOUTS:
        results[other] = {
            (layout, rank): torch.load(root / f"plain-{other}-layout-{layout}-rank{rank}.pt", weights_only=False)
            for layout in ("tp", "ep")
            for rank in (0, 1)
        }
    for name, (_, impl) in CASES.items():
        model = KimiHybridForCausalLM.from_pretrained(root / name, experts_implementation=impl)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        results[name] = {"ref": compute(model, torch.load(root / name / "inputs.pt")), "state": state}
        for layout in ("tp", "ep", "pp"):
            for rank in (0, 1):
                results[name][layout, rank] = torch.load(root / f"{name}-{layout}-rank{rank}.pt", weights_only=False)
    return results


MULTIMODAL = "multimodal_tied"


def write_tied_multimodal(folder: Path) -> Path:
    """A tiny KimiHybridForConditionalGeneration with tied input / output embeddings (embed_tokens cut by vocabulary
    rows, lm_head by output rows: one parameter, two plans), 4 heads of each kind, and an image in its inputs."""
    from kimi_hf import KimiHybridForConditionalGeneration

    from .helpers import tiny_multimodal_config, tiny_processor
    from .test_modeling_multimodal import img, prompt

    config = tiny_multimodal_config(tie_word_embeddings=True, linear_num_heads=HEADS, num_attention_heads=HEADS)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = KimiHybridForConditionalGeneration(config)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    model.save_pretrained(folder)
    proc = tiny_processor()
    image = proc(images=[img(56, 56)], text=prompt(proc))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (2, 24), generator=g)
    inputs = dict(
        ids=ids,
        packed_ids=ids[:1],
        packed_pos=torch.cat([torch.arange(10), torch.arange(14)])[None],
        prompt=torch.randint(3, 97, (1, 20), generator=g),
        new_tokens=6,
        image_ids=image["input_ids"],
        pixel_values=image["pixel_values"],
        image_grid_thw=image["image_grid_thw"],
    )
    torch.save(inputs, folder / "inputs.pt")
    return folder


# the "plain" checkpoint again in the other layouts the loader converts (conversion_mapping_kimi_hybrid.py)
OTHER_LAYOUTS = ("moonshot", "transformers")


def write_other_layout(src: Path, dst: Path, layout: str) -> None:
    """The checkpoint at src in another layout, two shards + index, the same config.json:
    "moonshot": Moonshot's Kimi-Linear release (what transformers' kimi_linear save_pretrained writes too): A_log
        [1, 1, H, 1], MoE blocks as block_sparse_moe with per-expert w1 / w3 / w2;
    "transformers": transformers' in-memory kimi_linear state dict: the decay gate's tensors under forget_gate.
        (A_log [1, 1, H, 1]), the q / k / v short convs stacked in one conv1d.weight, experts stacked.
    transformers' loader cuts A_log [1, 1, H, 1] on its first dim (all of it on rank 0) and the stacked convs by the
    q conv's placements (rank 0: q and half of k): the conversion has to gather them."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    state = load_file(src / "model.safetensors")
    out = {}
    for name, tensor in state.items():
        attn, _, leaf = name.rpartition("self_attn.")
        if leaf == "A_log":
            out[name if layout == "moonshot" else f"{attn}self_attn.forget_gate.A_log"] = tensor.reshape(1, 1, -1, 1)
        elif layout == "transformers" and leaf in ("dt_bias", "f_a_proj.weight", "f_b_proj.weight"):
            out[f"{attn}self_attn.forget_gate.{leaf}"] = tensor
        elif layout == "transformers" and leaf.endswith("_conv1d.weight"):
            if leaf.startswith("q"):
                out[f"{attn}self_attn.conv1d.weight"] = torch.cat(
                    [state[f"{attn}self_attn.{x}_conv1d.weight"] for x in "qkv"]
                )
        elif layout == "moonshot" and name.endswith("mlp.experts.gate_up_proj"):
            base = name.replace(".mlp.", ".block_sparse_moe.").removesuffix("gate_up_proj")
            for e, (w1, w3) in enumerate(zip(*tensor.chunk(2, 1))):
                out[f"{base}{e}.w1.weight"], out[f"{base}{e}.w3.weight"] = w1.contiguous(), w3.contiguous()
        elif layout == "moonshot" and name.endswith("mlp.experts.down_proj"):
            base = name.replace(".mlp.", ".block_sparse_moe.").removesuffix("down_proj")
            for e, w2 in enumerate(tensor):
                out[f"{base}{e}.w2.weight"] = w2.contiguous()
        elif layout == "moonshot":
            moe = name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            out[moe.replace(".mlp.shared", ".block_sparse_moe.shared")] = tensor
        else:
            out[name] = tensor
    dst.mkdir()
    names = sorted(out)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, keys in shards.items():
        save_file({k: out[k] for k in keys}, dst / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for file in ("config.json", "inputs.pt"):
        shutil.copy(src / file, dst / file)


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def assert_same_results(res: dict, ref: dict, keys: tuple[str, ...], atol: float) -> None:
    """A rank's results (tp_worker.compute) against one process's: the outputs named by keys within atol, greedy
    tokens equal, loss and every gradient within atol."""
    for key in keys:
        assert max_diff(res[key], ref[key]) < atol, (key, max_diff(res[key], ref[key]))
    assert torch.equal(res["tokens"], ref["tokens"])  # greedy generation with the cache
    assert abs(res["loss"].item() - ref["loss"].item()) < atol
    assert res["grads"].keys() == ref["grads"].keys()
    worst = max((max_diff(res["grads"][n], g), n) for n, g in ref["grads"].items())
    assert worst[0] < atol, worst


def expected_shard(full: torch.Tensor, placements: str, rank: int) -> torch.Tensor:
    """This rank's part of a parameter under a 1-D mesh of 2: torch.chunk on the sharded dim; gate_up_proj's
    strided shard (packed_colwise) takes the rank's part of the gate half and of the up half."""
    if placements.startswith("(_StridedShard(dim=1"):
        return torch.cat([half.chunk(2, 1)[rank] for half in full.chunk(2, 1)], 1)
    dim = int(placements.split("dim=")[1].split(")")[0].split(",")[0])
    return full.chunk(2, dim)[rank]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_matches_single_process(runs, case, layout):
    for rank in (0, 1):
        assert_same_results(runs[case][layout, rank], runs[case]["ref"], ("logits", "packed", "scores"), ATOL)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_multimodal_with_tied_embeddings(runs, layout):
    """The multimodal model with lm_head tied to embed_tokens: one parameter (sharded by vocabulary rows), the
    vision tower replicated; text, packed documents, an image, generation and gradients as in one process."""
    for rank in (0, 1):
        res = runs[MULTIMODAL][layout, rank]
        assert_same_results(res, runs[MULTIMODAL]["ref"], ("logits", "packed", "scores", "images"), ATOL)
        assert res["shards"]["model.language_model.embed_tokens.weight"]["placements"] == "(Shard(dim=0),)"
        assert "lm_head.weight" not in res["shards"] and "lm_head.weight" not in res["replicated"]  # tied: one
        assert not any(n.startswith("model.vision_tower.") for n in res["shards"])


@pytest.mark.parametrize("other", OTHER_LAYOUTS)
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_other_layouts_load_sharded_as_ours(runs, layout, other):
    """The "plain" checkpoint in Moonshot's / transformers' in-memory Kimi-Linear layout under TP / EP: every rank
    holds the same shards as from our layout (A_log [1, 1, H, 1] and the stacked convs gathered and cut by
    head), and computes the same."""
    for rank in (0, 1):
        got, ours = runs[other][layout, rank], runs["plain"][layout, rank]
        assert got["shards"].keys() == ours["shards"].keys()
        for name, shard in ours["shards"].items():
            assert torch.equal(got["shards"][name]["local"], shard["local"]), name
        for key in ("logits", "packed", "scores"):
            assert max_diff(got[key], runs["plain"]["ref"][key]) < ATOL, key


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_each_rank_holds_its_shard(runs, case, layout):
    """Every sharded parameter's local tensor is this rank's slice of the checkpoint's (heads, channels, experts)."""
    state = runs[case]["state"]
    for rank in (0, 1):
        shards = runs[case][layout, rank]["shards"]
        for name, shard in shards.items():
            assert torch.equal(shard["local"], expected_shard(state[name], shard["placements"], rank)), name


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_save_pretrained_gathers_the_shards(runs, layout):
    from safetensors.torch import load_file

    for case in CASES:
        saved, original = (
            load_file(runs["root"] / name / "model.safetensors") for name in (f"{case}-{layout}-saved", case)
        )
        assert saved.keys() == original.keys()
        for name, tensor in original.items():
            assert torch.equal(saved[name], tensor), name


@pytest.mark.parametrize("case", list(CASES))
def test_qk_clip_on_sharded_weights(runs, case):
    """apply_qk_clip(gamma of all heads) on TP-sharded MLA weights scales this rank's rows as the whole model does."""
    model = KimiHybridForCausalLM(case_config(case))
    model.load_state_dict(runs[case]["state"])
    for name, m in model.named_modules():
        if isinstance(m, KimiHybridMLA):
            m.apply_qk_clip(QK_CLIP_GAMMA)
    params = dict(model.named_parameters())
    for rank in (0, 1):
        clipped = runs[case]["tp", rank]["clipped"]
        assert clipped and all(name in params for name in clipped)
        for name, local in clipped.items():
            assert torch.allclose(local, params[name].detach().chunk(2, 0)[rank], atol=1e-7), name
        assert not torch.equal(local, runs[case]["state"][name].chunk(2, 0)[rank])  # it did scale


@pytest.mark.parametrize("layout", ["tp", "ep"])
@pytest.mark.parametrize("case", list(CASES))
def test_qk_clip_records_every_head_under_tensor_parallelism(runs, case, layout):
    """Each rank records the max logits of its own MLA heads; after the all-reduce every rank holds the whole
    model's per-head maxima, in the heads' order (a rank's heads land at its slots)."""
    model = KimiHybridForCausalLM(case_config(case))
    model.load_state_dict(runs[case]["state"])
    expected = record_max_logits(model, torch.load(runs["root"] / case / "inputs.pt"))
    for rank in (0, 1):
        got = runs[case][layout, rank]["qk_max"]
        assert len(got) == len(expected) > 0
        for g, e in zip(got, expected):
            assert g.shape == (HEADS,)
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-5)


def local_shapes(runs, case, layout):
    return {n: tuple(s["local"].shape) for n, s in runs[case][layout, 0]["shards"].items()}


def test_kda_and_mla_shard_by_head(runs):
    shapes, res = local_shapes(runs, "plain", "tp"), runs["plain"]["tp", 0]
    h, K, hidden = HEADS // 2, 8, 32  # local heads, linear_head_dim, hidden_size
    kda = "model.layers.0.self_attn."
    for proj in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj"):
        assert shapes[kda + proj + ".weight"] == (h * K, shapes[kda + proj + ".weight"][1])
    assert shapes[kda + "b_proj.weight"] == (h, hidden)
    for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
        assert shapes[kda + conv + ".weight"] == (h * K, 1, 4)
    assert shapes[kda + "A_log"] == (h,) and shapes[kda + "dt_bias"] == (h * K,)
    assert shapes[kda + "o_proj.weight"] == (hidden, h * K)
    mla = "model.layers.3.self_attn."
    assert shapes[mla + "q_proj.weight"] == (h * (8 + 4), hidden)  # qk_nope + qk_rope
    assert shapes[mla + "kv_b_proj.weight"] == (h * (8 + 8), 16)  # (qk_nope + v) x kv_lora_rank
    assert shapes[mla + "o_proj.weight"] == (hidden, h * 8)
    assert local_shapes(runs, "lora_attnres", "tp")["model.layers.0.self_attn.q_b_proj.weight"] == (h * 12, 8)
    # shared by the heads: replicated
    for name in (
        kda + "f_a_proj.weight",
        kda + "g_a_proj.weight",
        kda + "o_norm.weight",
        mla + "kv_a_proj_with_mqa.weight",
        mla + "kv_a_layernorm.weight",
        "model.layers.1.mlp.gate.weight",
        "model.norm.weight",
    ):
        assert name in res["replicated"], name
    assert {
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.attn_res.query",
        "model.final_res.query",
    } <= runs["lora_attnres"]["tp", 0]["replicated"].keys()
    assert shapes["model.embed_tokens.weight"] == (49, hidden) and shapes["lm_head.weight"] == (49, hidden)


def test_tp_splits_each_expert_and_ep_the_experts(runs):
    for case in CASES:
        tp, ep = local_shapes(runs, case, "tp"), local_shapes(runs, case, "ep")
        experts = "model.layers.1.mlp.experts."
        assert tp[experts + "gate_up_proj"] == (4, 16, 32) and tp[experts + "down_proj"] == (4, 32, 8)
        assert ep[experts + "gate_up_proj"] == (2, 32, 32) and ep[experts + "down_proj"] == (2, 32, 16)
        assert runs[case]["ep", 0]["shards"][experts + "gate_up_proj"]["placements"] == "(Shard(dim=0),)"
        assert runs[case]["ep", 1]["local_experts"] == [2, 2, 2] and runs[case]["tp", 1]["local_experts"] == [4, 4, 4]
        # the dense parts stay tensor-parallel under ep
        assert ep["model.layers.0.mlp.gate_proj.weight"] == tp["model.layers.0.mlp.gate_proj.weight"] == (24, 32)
    assert runs["plain"]["ep", 0]["experts_implementation"] == "grouped_mm"
    assert runs["lora_attnres"]["ep", 0]["experts_implementation"] == "eager"


def test_pipeline_parallel(runs):
    ref = runs["plain"]["ref"]
    layers = ["KimiHybridDecoderLayer"] * 2 + ["PipelineIdentityLayer"] * 2
    for rank in (0, 1):
        res = runs["plain"]["pp", rank]
        assert res["layers"] == (layers if rank == 0 else layers[::-1])
        for key in ("logits", "packed", "scores"):
            assert max_diff(res[key], ref[key]) < ATOL, key
        assert torch.equal(res["tokens"], ref["tokens"])
        # Attention Residuals pass two tensors between layers: refused at load on both ranks
        assert "Attention Residuals under pipeline parallelism" in runs["lora_attnres"]["pp", rank]["refused"]


# ---- without processes -------------------------------------------------------------------------------------------


def wildcard_names(model):
    import re

    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    return {re.sub(r"\.\d+(\.|$)", r".*\1", n) for n in names}


def test_plans_match_the_model():
    """Every rule names a module or parameter of some architecture; an instance's TP plan only those it has."""
    covered = set()
    for over in (dict(), dict(q_lora_rank=8), dict(attn_residual="block"), dict(mla_use_output_gate=True)):
        config = tiny_config(**over)
        model = KimiHybridForCausalLM(config)
        names = {n.removeprefix("model.") for n in wildcard_names(model)}
        assert set(config.base_model_tp_plan) <= names, set(config.base_model_tp_plan) - names
        assert set(config.base_model_ep_plan) <= names
        assert set(config.base_model_pp_plan) <= {n for n in names if "." not in n}
        assert model.tp_plan["lm_head"] == "colwise_gather_output"
        assert model.tp_plan["model.embed_tokens"] == "embedding_rowwise"  # added by transformers
        covered |= set(config.base_model_tp_plan)
    assert covered == set(TP_PLAN)
    assert "layers.*.self_attn.q_b_proj" not in tiny_config().base_model_tp_plan
    mla_only = tiny_config(layer_types=["full_attention"] * 4, mlp_layer_types=["sparse"] * 4)
    assert not any("conv1d" in k or "A_log" in k or k == "layers.*.mlp.gate_proj" for k in mla_only.base_model_tp_plan)
    assert tiny_config().base_model_ep_plan == EP_PLAN


def test_pp_plan_describes_the_attn_res_layer():
    assert tiny_config().base_model_pp_plan == PP_PLAN
    plan = tiny_config(attn_residual="block").base_model_pp_plan
    assert plan == ATTN_RES_PP_PLAN
    assert plan["layers"] == (["hidden_states", "depth_blocks", "attention_mask"], ["hidden_states", "depth_blocks"])
    assert list(plan) == ["embed_tokens", "layers", "final_res", "norm"]  # the order of the forward


def test_layouts_the_model_cannot_run_are_refused():
    from transformers.distributed import DistributedConfig

    from kimi_hf.models.kimi_hybrid.parallel_kimi_hybrid import check_parallel_layout

    plan = KimiHybridForCausalLM(tiny_config()).tp_plan
    check_parallel_layout(tiny_config(), plan, DistributedConfig(tp_size=2))
    with pytest.raises(ValueError, match="linear_num_heads"):
        check_parallel_layout(tiny_config(linear_num_heads=3), plan, DistributedConfig(tp_size=2))
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_parallel_layout(tiny_config(num_attention_heads=3), plan, DistributedConfig(tp_size=2))
    # a plan that does not shard kv_b_proj by head lifts the MLA constraint
    check_parallel_layout(
        tiny_config(num_attention_heads=3),
        plan,
        DistributedConfig(tp_size=2, tp_plan={"model.layers.*.self_attn.kv_b_proj": "replicate"}),
    )
    with pytest.raises(ValueError, match="Attention Residuals under pipeline parallelism"):
        check_parallel_layout(tiny_config(attn_residual="block"), plan, DistributedConfig(pp_size=2))


def test_plans_are_not_serialized_and_follow_changes():
    config = tiny_config()
    assert not any("plan" in key for key in config.to_dict())
    config.q_lora_rank = 8
    assert "layers.*.self_attn.q_b_proj" in config.base_model_tp_plan


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_experts_skip_routes_to_other_ranks(impl):
    """Under expert parallelism a rank holds num_experts / ep experts; transformers marks a route to another rank's
    expert with the local index num_experts and weight 0: the eager forward must skip it too."""
    config = tiny_config()
    config._experts_implementation = impl
    torch.manual_seed(0)
    full = KimiHybridExperts(config)
    with torch.no_grad():
        full.gate_up_proj.normal_(), full.down_proj.normal_()
    x = torch.randn(7, 32)
    indices = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    weights = torch.rand(7, 2)
    out = torch.zeros_like(x)
    for rank in (0, 1):  # what transformers' AllReduceEP does, rank by rank
        local = KimiHybridExperts(config)
        local.num_experts, local._is_expert_parallel = 2, True
        local.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[2 * rank : 2 * rank + 2].detach().clone())
        local.down_proj = torch.nn.Parameter(full.down_proj[2 * rank : 2 * rank + 2].detach().clone())
        off = indices // 2 != rank
        out += local(x, torch.where(off, 2, indices % 2), weights.masked_fill(off, 0.0))
    torch.testing.assert_close(out, full(x, indices, weights), atol=1e-5, rtol=1e-5)


def test_qk_clip_on_local_heads():
    """Under tensor parallelism the max-logit recorder sees this rank's heads: apply_qk_clip takes their gammas and
    scales the local rows as the full model scales those heads' rows."""
    config = tiny_config(num_attention_heads=HEADS)
    torch.manual_seed(0)
    full = KimiHybridMLA(config, 3)
    gamma = torch.tensor([0.5, 1.0, 0.25, 0.8])
    rows_q, rows_kv = 8 + 4, 8 + 8  # per head: qk_nope + qk_rope, qk_nope + v
    local = KimiHybridMLA(config, 3)
    local.q_proj.weight = torch.nn.Parameter(full.q_proj.weight[2 * rows_q :].detach().clone())
    local.kv_b_proj.weight = torch.nn.Parameter(full.kv_b_proj.weight[2 * rows_kv :].detach().clone())
    full.apply_qk_clip(gamma)
    local.apply_qk_clip(gamma[2:])  # this rank's heads 2 and 3
    assert torch.equal(local.q_proj.weight, full.q_proj.weight[2 * rows_q :])
    assert torch.equal(local.kv_b_proj.weight, full.kv_b_proj.weight[2 * rows_kv :])
    with pytest.raises(ValueError, match=r"one factor per head \(4\) or per local head \(2\), got shape \(3,\)"):
        local.apply_qk_clip(gamma[:3])
