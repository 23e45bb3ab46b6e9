"""Kimi K3's routed experts kept in MXFP4 in memory (`from_pretrained(k3_dir, experts_format="mxfp4")`, the default
for a released folder): the same logits and greedy tokens as the dequantised model, the experts' bytes resident as
loaded (4.25 bits a weight), written back bit for bit by save_pretrained, training of the experts refused, and the
checks of bad MXFP4 tensors at load."""

import copy
import glob
import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kimi_hf import KimiK3ForConditionalGeneration
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridExperts, KimiHybridMxfp4Experts

from .release_format import tiny_k3_config, write_k3_checkpoint


def read_folder(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def fp32_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3_fp32_mxfp4")
    write_k3_checkpoint(folder, tiny_k3_config(), seed=3, mxfp4=True, shards=3, dtype="float32")
    return str(folder)


@pytest.fixture(scope="module")
def models(fp32_folder):
    resident = KimiK3ForConditionalGeneration.from_pretrained(fp32_folder)
    dense = KimiK3ForConditionalGeneration.from_pretrained(fp32_folder, experts_format="dense")
    eager = KimiK3ForConditionalGeneration.from_pretrained(
        fp32_folder, experts_format="dense", experts_implementation="eager"
    )
    return resident, dense, eager


def experts_modules(model):
    return [m for m in model.modules() if isinstance(m, (KimiHybridExperts, KimiHybridMxfp4Experts))]


def test_resident_by_default_and_dense_on_request(models):
    resident, dense, _ = models
    assert resident.experts_format == "mxfp4" and dense.experts_format == "dense"
    assert {type(m) for m in experts_modules(resident)} == {KimiHybridMxfp4Experts}
    assert {type(m) for m in experts_modules(dense)} == {KimiHybridExperts}
    for m in experts_modules(resident):
        for name in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
            p = getattr(m, name)
            assert p.dtype == torch.uint8 and not p.requires_grad


def test_resident_bytes_are_the_checkpoint_bytes(models, fp32_folder):
    """The experts hold exactly the released packed + scale bytes (17 bytes per 32 weights): nothing dense."""
    resident, dense, _ = models
    stored = read_folder(fp32_folder)
    mx_bytes = sum(t.numel() for k, t in stored.items() if k.endswith((".weight_packed", ".weight_scale")))
    held = sum(p.numel() * p.element_size() for m in experts_modules(resident) for p in m.parameters())
    assert held == mx_bytes
    dense_bytes = sum(p.numel() * p.element_size() for m in experts_modules(dense) for p in m.parameters())
    assert held * 32 == dense_bytes * 17 // 4  # fp32: 32 weights = 128 bytes -> 17
    # every packed expert of a layer is the stacked slice it went into (w1 rows, then w3; w2)
    layer = next(i for i, m in enumerate(resident.model.language_model.layers) if hasattr(m.mlp, "experts"))
    experts = resident.model.language_model.layers[layer].mlp.experts
    prefix = f"language_model.model.layers.{layer}.block_sparse_moe.experts"
    I = experts.down_proj.shape[-1] * 2
    dense_experts = dense.model.language_model.layers[layer].mlp.experts
    for name in ("gate_up_proj", "down_proj"):  # the whole layer decoded at once: the dense model's tensor
        assert torch.equal(experts.dequantized(name), getattr(dense_experts, name))
    for e in range(experts.num_experts):
        assert torch.equal(experts.gate_up_proj[e, :I], stored[f"{prefix}.{e}.w1.weight_packed"])
        assert torch.equal(experts.gate_up_proj_scale[e, I:], stored[f"{prefix}.{e}.w3.weight_scale"])
        assert torch.equal(experts.down_proj[e], stored[f"{prefix}.{e}.w2.weight_packed"])


def test_logits_and_greedy_tokens_equal_the_dequantised_model(models):
    resident, dense, eager = models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (2, 24), generator=g)
    with torch.no_grad():
        r, d, e = (m(ids).logits for m in (resident, dense, eager))
    # the same per-expert F.linear as the dense eager loop: bitwise; the default grouped_mm sums in another order
    assert torch.equal(r, e)
    assert (r - d).abs().max().item() <= 1e-5 * max(1.0, d.abs().max().item())
    prompt = ids[:1, :10]
    kwargs = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(resident.generate(prompt, **kwargs), dense.generate(prompt, **kwargs))


def test_save_writes_the_packed_bytes_back_bit_for_bit(models, fp32_folder, tmp_path):
    resident, dense, _ = models
    resident.save_pretrained(tmp_path / "resident")
    dense.save_pretrained(tmp_path / "dense")  # loaded from MXFP4 and still on its grid: MXFP4 as well (lossless)
    source, saved, saved_dense = (read_folder(p) for p in (fp32_folder, tmp_path / "resident", tmp_path / "dense"))
    assert set(saved) == set(source) == set(saved_dense)
    for k in source:
        assert saved[k].dtype == source[k].dtype and torch.equal(saved[k], source[k]), k
    with open(tmp_path / "resident" / "config.json") as f:
        assert json.load(f)["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    reloaded = KimiK3ForConditionalGeneration.from_pretrained(tmp_path / "resident")
    assert reloaded.experts_format == "mxfp4"
    # dense on request: dequantised, exactly the dense model's experts
    resident.save_pretrained(tmp_path / "as_dense", saved_experts="dense")
    as_dense = read_folder(tmp_path / "as_dense")
    key = next(k for k in as_dense if ".experts.0.w1.weight" in k)
    want = dense.state_dict()[next(k for k in dense.state_dict() if k.endswith("mlp.experts.gate_up_proj"))]
    assert as_dense[key].dtype == torch.float32 and torch.equal(as_dense[key], want[0, : as_dense[key].shape[0]])
    with pytest.raises(ValueError, match="save_original_format=False.*experts_format='mxfp4'"):
        resident.save_pretrained(tmp_path / "ours", save_original_format=False)


def test_load_state_dict_of_the_released_layout_copies_the_bytes(models, fp32_folder):
    """Trainer's resume path (load_state_dict of a released checkpoint's shards) into resident experts."""
    resident, _, _ = models
    experts = experts_modules(resident)[0]
    before = experts.gate_up_proj.clone(), experts.down_proj_scale.clone()
    with torch.no_grad():
        experts.gate_up_proj.zero_()
        experts.down_proj_scale.zero_()
    for path in sorted(glob.glob(os.path.join(fp32_folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            resident.load_state_dict({k: f.get_tensor(k) for k in f.keys()}, strict=False)
    assert torch.equal(experts.gate_up_proj, before[0]) and torch.equal(experts.down_proj_scale, before[1])


def test_training_the_experts_is_refused_with_an_explanation(models):
    resident, _, _ = models
    ids = torch.randint(3, 97, (1, 12))
    resident.train()
    try:
        resident.requires_grad_(True)  # floating parameters only: the bytes stay frozen, no torch error
        assert all(not p.requires_grad for m in experts_modules(resident) for p in m.parameters())
        with pytest.raises(ValueError, match="experts_format='dense'"):
            resident(ids, labels=ids)
        # the MoE layers frozen (what PEFT does): the rest trains, gradients flow through the frozen experts
        for m in resident.modules():
            if hasattr(m, "experts") and hasattr(m, "gate"):
                m.requires_grad_(False)
        resident(ids, labels=ids).loss.backward()
        q = resident.model.language_model.layers[0].self_attn.q_proj.weight
        assert q.grad is not None and q.grad.abs().sum() > 0
    finally:
        resident.eval()
        resident.requires_grad_(True)
        resident.zero_grad(set_to_none=True)


def test_experts_format_errors(fp32_folder, tmp_path):
    with pytest.raises(ValueError, match="experts_format must be one of"):
        KimiK3ForConditionalGeneration.from_pretrained(fp32_folder, experts_format="fp8")
    dense_folder = tmp_path / "dense"
    write_k3_checkpoint(dense_folder, tiny_k3_config(), seed=3, mxfp4=False, shards=1, dtype="float32")
    with pytest.raises(ValueError, match="experts_format='mxfp4'.*not stored in MXFP4"):
        KimiK3ForConditionalGeneration.from_pretrained(dense_folder, experts_format="mxfp4")
    assert KimiK3ForConditionalGeneration.from_pretrained(dense_folder).experts_format == "dense"


def _corrupt(folder, tmp_path, edit) -> str:
    """A copy of folder whose first layer-1 expert tensors are changed by edit(dict) in their shard."""
    out = tmp_path / "corrupt"
    shutil.copytree(folder, out)
    key = next(k for k in read_folder(folder) if ".experts.0.w1.weight_packed" in k)
    with open(out / "model.safetensors.index.json") as f:
        shard = out / json.load(f)["weight_map"][key]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    edit(tensors, key)
    save_file(tensors, str(shard), metadata=metadata)
    return str(out)


@pytest.mark.parametrize("experts_format", ["mxfp4", "dense"])
@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda t, k: t.__setitem__(k, t[k][:, :-16].contiguous()),
            r"weight_packed \(model-.*\): shape \[\d+, \d+\], expected",
        ),
        (
            lambda t, k: t.__setitem__(k, t[k].to(torch.int16)),
            r"weight_packed \(model-.*\): MXFP4 weight_packed must be uint8 \(U8\), got I16",
        ),
        (
            lambda t, k: t[k.replace("weight_packed", "weight_scale")].__setitem__((0, 0), 255),
            "weight_scale holds the E8M0 NaN byte 255",
        ),
    ],
    ids=["packed_shape", "packed_dtype", "nan_scale"],
)
def test_bad_mxfp4_tensors_are_named(fp32_folder, tmp_path, edit, message, experts_format):
    folder = _corrupt(fp32_folder, tmp_path, edit)
    with pytest.raises(ValueError, match=message) as caught:
        KimiK3ForConditionalGeneration.from_pretrained(folder, experts_format=experts_format)
    assert "experts" in str(caught.value)  # names the tensor


def test_resident_experts_compile_without_graph_breaks(models):
    """torch.compile(fullgraph=True) of resident experts (what generate's compiled decoding traces) takes the static-shape
    path, every expert dequantised in turn, and gives the eager routed result. Two of a layer's experts (compiling
    costs about 10 s an expert on 2 cores)."""
    resident, _, _ = models
    layer = next(
        m.experts for m in resident.modules() if isinstance(getattr(m, "experts", None), KimiHybridMxfp4Experts)
    )
    config = copy.deepcopy(resident.config.text_config)
    config.num_experts, config.num_experts_per_tok = 2, 1
    experts = KimiHybridMxfp4Experts(config)
    with torch.no_grad():
        for name, p in experts.named_parameters():
            p.copy_(getattr(layer, name)[:2])
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, experts.gate_up_proj.shape[-1] * 2, generator=g)
    indices, weights = torch.randint(0, 2, (5, 1), generator=g), torch.rand(5, 1, generator=g)
    with torch.no_grad():
        eager = experts(x, indices, weights)
        static = experts._dense_forward(x, indices, weights)
        compiled = torch.compile(experts, fullgraph=True, backend="eager")(x, indices, weights)
    # fp32, outputs up to ~1: the static path multiplies all 5 rows at once (another GEMM blocking), observed 2e-5
    torch.testing.assert_close(static, eager, rtol=0, atol=1e-4)
    torch.testing.assert_close(compiled, static, rtol=0, atol=1e-6)
