"""MuonClip: Newton-Schulz, the Muon and AdamW parts against torch's optimizers, grouping by role,
state_dict resume, precision."""

import copy
import re

import pytest
import torch
from torch import nn

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.optim import MuonClip, split_params, zeropower_via_newtonschulz5
from kimi_hf.optim.muon import muon_scale

from ..models.kimi_hybrid.helpers import tiny_config
from ..models.kimi_k3.release_format import tiny_k3_config


def test_newton_schulz_orthogonalises_and_batches():
    G = torch.randn(3, 40, 24)
    O = zeropower_via_newtonschulz5(G)
    sv = torch.linalg.svdvals(O)
    assert sv.min() > 0.5 and sv.max() < 1.5  # ~U V^T with singular values in about (0.5, 1.5)
    for i in range(3):  # a batch is each matrix orthogonalised on its own
        assert torch.allclose(O[i], zeropower_via_newtonschulz5(G[i]), atol=1e-6)
    U, _, Vh = torch.linalg.svd(G[0], full_matrices=False)
    assert torch.nn.functional.cosine_similarity(O[0].flatten(), (U @ Vh).flatten(), dim=0) > 0.95


def test_muon_part_matches_torch_muon():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(32, 48))
    w0 = w.detach().clone()
    w_ref = nn.Parameter(w.detach().clone())
    ours = MuonClip([{"params": [w], "use_muon": True}], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([w_ref], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(4):
        g = torch.randn(32, 48, generator=torch.Generator().manual_seed(step))
        w.grad, w_ref.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    # both run Newton-Schulz in bf16 (torch fuses it into addmm: different rounding): compare the
    # displacement of the weights
    moved, moved_ref = w.detach() - w0, w_ref.detach() - w0
    assert (moved - moved_ref).norm() / moved_ref.norm() < 2e-2


def test_adamw_part_matches_torch_adamw():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(5, 3))]
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    ours = MuonClip(params, lr=1e-2, weight_decay=0.05, adamw_betas=(0.8, 0.9), adamw_eps=1e-6)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-6)
    for step in range(5):
        for p, r in zip(params, ref_params):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad, r.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    for p, r in zip(params, ref_params):
        assert torch.allclose(p, r, atol=1e-6)


def test_update_scale_is_moonlight_rule():
    w = nn.Parameter(torch.zeros(16, 64))
    opt = MuonClip([{"params": [w], "use_muon": True}], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False)
    w.grad = torch.randn(16, 64)
    opt.step()
    expected = -0.1 * muon_scale((16, 64)) * zeropower_via_newtonschulz5(w.grad)
    assert torch.allclose(w, expected, atol=1e-6)
    assert muon_scale((16, 64)) == pytest.approx(0.2 * 8)


def test_muon_group_rejects_vectors_naming_the_group():
    with pytest.raises(ValueError, match=r"param_groups\[1\].*use_muon"):
        MuonClip(
            [
                {"params": [nn.Parameter(torch.randn(4, 4))], "use_muon": True},
                {"params": [nn.Parameter(torch.randn(4))], "use_muon": True},
            ]
        )
    with pytest.raises(ValueError, match="momentum"):
        MuonClip([nn.Parameter(torch.randn(3))], momentum=1.5)


def test_split_params_by_role():
    model = KimiHybridForCausalLM(tiny_config())
    muon, adamw = split_params(model)
    name = {id(p): n for n, p in model.named_parameters()}
    muon_names, adamw_names = {name[id(p)] for p in muon}, {name[id(p)] for p in adamw}
    assert muon_names.isdisjoint(adamw_names) and len(muon) + len(adamw) == len(list(model.parameters()))
    for must in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.experts.gate_up_proj",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
    ):
        assert must in muon_names, must
    for must in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.A_log",
        "model.layers.0.self_attn.dt_bias",
        "model.layers.0.self_attn.q_conv1d.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.o_norm.weight",
    ):
        assert must in adamw_names, must


# Kimi K3's parameters (layer indices as *: KDA and MLA layers share `self_attn.o_proj` / `self_attn.g_proj`, dense
# and MoE layers nothing else) by role: (rule, role, names). Written from the rules, not read off split_params.
K3_ROLES = [
    ("embeddings and the output head", "adamw", ["model.language_model.embed_tokens.weight", "lm_head.weight"]),
    (
        "Attention Residual pseudo-queries [d] and their key norms",
        "adamw",
        [
            f"model.language_model.{m}.{t}"
            for m in ("layers.*.attn_res", "layers.*.mlp_res", "final_res")
            for t in ("query", "key_norm.weight")
        ],
    ),
    (
        "KDA decay parameters",
        "adamw",
        ["model.language_model.layers.*.self_attn.A_log", "model.language_model.layers.*.self_attn.dt_bias"],
    ),
    (
        "KDA short convs [D, 1, W] (depthwise kernels, not matrices)",
        "adamw",
        [f"model.language_model.layers.*.self_attn.{x}_conv1d.weight" for x in "qkv"],
    ),
    (
        "text norms (RMSNorms, KDA o_norm, MLA latent norms, latent-MoE norm)",
        "adamw",
        [
            "model.language_model.layers.*.input_layernorm.weight",
            "model.language_model.layers.*.post_attention_layernorm.weight",
            "model.language_model.layers.*.self_attn.o_norm.weight",
            "model.language_model.layers.*.self_attn.q_a_layernorm.weight",
            "model.language_model.layers.*.self_attn.kv_a_layernorm.weight",
            "model.language_model.layers.*.mlp.routed_expert_norm.weight",
            "model.language_model.norm.weight",
        ],
    ),
    (
        "MoE router weight (e_score_correction_bias is a buffer)",
        "adamw",
        ["model.language_model.layers.*.mlp.gate.weight"],
    ),
    (
        "vision tower: patch-embedding conv, position table [H, W, C], RMSNorms; projector post-norm",
        "adamw",
        [
            "model.vision_tower.patch_embed.proj.weight",
            "model.vision_tower.patch_embed.pos_emb.position_embeddings",
            "model.vision_tower.layers.*.norm1.weight",
            "model.vision_tower.layers.*.norm2.weight",
            "model.vision_tower.final_layernorm.weight",
            "model.mm_projector.post_norm.weight",
        ],
    ),
    (
        "KDA projections (q, k, v, f_a, f_b, b, full-rank g, o)",
        "muon",
        [
            f"model.language_model.layers.*.self_attn.{x}.weight"
            for x in ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_proj", "o_proj")
        ],
    ),
    (
        "MLA with q LoRA (its g_proj / o_proj: the KDA row's names)",
        "muon",
        [
            f"model.language_model.layers.*.self_attn.{x}.weight"
            for x in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
        ],
    ),
    (
        "dense MLP and shared experts",
        "muon",
        [f"model.language_model.layers.*.mlp.{x}.weight" for x in ("gate_proj", "up_proj", "down_proj")]
        + [
            f"model.language_model.layers.*.mlp.shared_experts.{x}.weight"
            for x in ("gate_proj", "up_proj", "down_proj")
        ],
    ),
    (
        "Stable LatentMoE bridges",
        "muon",
        [f"model.language_model.layers.*.mlp.routed_expert_{x}_proj.weight" for x in ("down", "up")],
    ),
    (
        "stacked routed experts [E, out, in] (per expert)",
        "muon",
        [
            "model.language_model.layers.*.mlp.experts.gate_up_proj",
            "model.language_model.layers.*.mlp.experts.down_proj",
        ],
    ),
    (
        "vision tower and projector linears (as for K2.5's tower)",
        "muon",
        [f"model.vision_tower.layers.*.{x}.weight" for x in ("attn.qkv_proj", "attn.proj", "mlp.fc1", "mlp.fc2")]
        + ["model.mm_projector.proj.0.weight", "model.mm_projector.proj.2.weight"],
    ),
]


def test_k3_parameter_roles_match_the_table():
    from kimi_hf import KimiK3ForConditionalGeneration
    from kimi_hf.models.kimi_k3.configuration_kimi_k3 import KimiK3Config

    model = KimiK3ForConditionalGeneration(KimiK3Config(**tiny_k3_config()))
    expected = {}
    for rule, role, names in K3_ROLES:
        for name in names:
            assert name not in expected, f"{name} in two rows of the table"
            expected[name] = (role, rule)
    muon, adamw = split_params(model)
    muon_ids, adamw_ids = {id(p) for p in muon}, {id(p) for p in adamw}
    assert muon_ids.isdisjoint(adamw_ids)
    seen = set()
    for name, p in model.named_parameters():
        key = re.sub(r"\.layers\.\d+\.", ".layers.*.", name)
        assert key in expected, f"{name}: not in the table"
        role = "muon" if id(p) in muon_ids else "adamw" if id(p) in adamw_ids else None
        assert role == expected[key][0], f"{name}: {role}, expected {expected[key][0]} ({expected[key][1]})"
        seen.add(key)
    assert seen == expected.keys()  # every row names tensors the model has
    assert len(muon) + len(adamw) == len(list(model.parameters()))
    # Muon gets matrices [A, B] and stacked experts [E, A, B] only; the only 3-D ones are the experts
    assert all(p.ndim == 2 or p.shape[0] == model.config.text_config.num_experts for p in muon)
    opt = MuonClip.from_model(model, qk_clip_tau=None)
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert all(decay[id(p)] == 0.0 for p in adamw if p.ndim < 2)  # norms, queries, A_log, dt_bias: no decay
    assert all(decay[id(p)] == 0.1 for p in muon)


def test_tied_embeddings_stay_with_adamw():
    model = KimiHybridForCausalLM(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    muon, adamw = split_params(model)
    assert all(p is not model.lm_head.weight for p in muon)


def train_steps(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(3, 97, (2, 16), generator=gen)
        model(x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_resume_is_bit_identical(tmp_path):
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config()).train()
    opt = MuonClip.from_model(model, lr=1e-2, qk_clip_tau=5.0)
    train_steps(model, opt, 2)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    train_steps(model, opt, 3, seed=1)

    ckpt = torch.load(tmp_path / "ckpt.pt")
    model2 = KimiHybridForCausalLM(tiny_config()).train()
    model2.load_state_dict(ckpt["model"])
    opt2 = MuonClip.from_model(model2, lr=1e-2, qk_clip_tau=5.0)
    opt2.load_state_dict(ckpt["opt"])
    train_steps(model2, opt2, 3, seed=1)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_params_keep_an_fp32_momentum_untouched_by_the_update(nesterov):
    w = nn.Parameter(torch.randn(8, 12, dtype=torch.bfloat16))
    opt = MuonClip([{"params": [w], "use_muon": True}], lr=0.01, nesterov=nesterov)
    g = torch.randn(8, 12, dtype=torch.bfloat16)
    w.grad = g.clone()
    opt.step()
    buf = opt.state[w]["momentum_buffer"]
    assert buf.dtype == torch.float32
    assert torch.allclose(buf, 0.05 * g.float())  # (1 - mu) * g after one step, not normalised in place
    assert w.dtype == torch.bfloat16 and torch.isfinite(w.float()).all()


def test_muon_runs_on_a_compiled_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    for m, runner in ((model, compiled), (reference, reference)):
        opt = MuonClip.from_model(m, lr=0.02, qk_clip_tau=None)
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            runner(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_expert_batches_split_only_on_the_expert_dim_are_orthogonalised_locally():
    """Which DTensor parameters Newton-Schulz runs on in place (no gather): stacked experts [E, A, B] split on dim 0
    only, including FSDP2 over the expert-parallel mesh (an outer _StridedShard of dim 0); anything else is
    gathered whole."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from kimi_hf.optim.muon import _whole_experts_locally

    def param(ndim, *placements):
        return SimpleNamespace(ndim=ndim, placements=placements)

    assert _whole_experts_locally(param(3, Shard(0)))  # expert parallelism, or FSDP2 alone
    assert _whole_experts_locally(param(3, _StridedShard(0, split_factor=2), Shard(0)))  # FSDP2 (efsdp) x EP
    assert _whole_experts_locally(param(3, Replicate(), _StridedShard(0, split_factor=2), Shard(0)))  # HSDP x EP
    assert not _whole_experts_locally(param(3, Shard(1)))  # an expert's rows split: gathered
    assert not _whole_experts_locally(param(3, _StridedShard(1, split_factor=2), Shard(0)))
    assert not _whole_experts_locally(param(2, Shard(0)))  # a matrix's rows (FSDP2 of a linear layer)
