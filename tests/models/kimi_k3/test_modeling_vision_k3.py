"""Kimi K3's vision tower (MoonViT3d with K3's switches) and patchmergerv2 projector as options of
KimiHybridVisionModel / build_multimodal_projector: an independent float64 reference written from the K3
architecture (plain loops per image, block and head; none of the module's code), loaded through
moonvit_key_mapping from tensors in the release's names; the interleaved 2D RoPE's pair order on a hand-made
case; the released vision_config read and written back by KimiK3VisionConfig; its errors name the field; the
full-size tower's names, shapes and parameter count (meta device); K2.5's defaults unchanged."""

import math
import re

import pytest
import torch
from transformers.core_model_loading import WeightRenaming, apply_renamings

from kimi_hf import KimiHybridConfig, KimiHybridVisionConfig, KimiHybridVisionModel
from kimi_hf.conversion.k25_vision import interleaved_to_half
from kimi_hf.models.kimi_hybrid.conversion_mapping_kimi_hybrid import moonvit_key_mapping
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid_vision import (
    KimiHybridMultimodalProjector,
    KimiHybridMultimodalProjectorV2,
    apply_rope,
    build_multimodal_projector,
    interleaved_rope,
)
from kimi_hf.models.kimi_k3.configuration_kimi_k3_vision import KimiK3VisionConfig

from ..kimi_hybrid.helpers import TINY, TINY_VISION


# Kimi K3's released vision_config, verbatim values.
RELEASED = {
    "_attn_implementation": "flash_attention_2",
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "pos_emb_interpolation_mode": "bilinear",
    "vt_hidden_size": 1024,
    "vt_num_hidden_layers": 27,
    "vt_num_attention_heads": 12,
    "qkv_hidden_size": 1536,
    "vt_intermediate_size": 4096,
    "norm_type": "rmsnorm",
    "attn_bias": False,
    "linear_bias": False,
    "patch_embed_proj_bias": False,
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": 1024,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
    "text_hidden_size": 7168,
}
# The release's spelling at tiny sizes: head_dim = qkv / heads = 32, not vt_hidden / heads = 16.
TINY_K3 = dict(
    RELEASED,
    init_pos_emb_height=8,
    init_pos_emb_width=8,
    vt_hidden_size=32,
    vt_num_hidden_layers=2,
    vt_num_attention_heads=2,
    qkv_hidden_size=64,
    vt_intermediate_size=64,
    mm_hidden_size=32,
    text_hidden_size=48,
)
GRID = torch.tensor([[1, 8, 8], [1, 6, 10]])  # the table's own size, then a bilinear resample (down rows, up cols)
FP32_EPS = float(torch.finfo(torch.float32).eps)  # nn.RMSNorm(dim) without eps, run in fp32


def released_tensors(vc: dict, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Random float64 tensors under the release's names: (tower, projector), each relative to its root (the
    release's `vision_tower.` / `mm_projector.` prefixes stripped)."""
    g = torch.Generator().manual_seed(seed)
    C, p, I = vc["vt_hidden_size"], vc["patch_size"], vc["vt_intermediate_size"]
    qkv, text = vc["qkv_hidden_size"], vc["text_hidden_size"]
    k = vc["merge_kernel_size"][0] * vc["merge_kernel_size"][1]

    def lin(out, inp):
        return torch.randn(out, inp, generator=g, dtype=torch.float64) / math.sqrt(inp)

    def norm(n):
        return 1 + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)

    tower = {
        "patch_embed.proj.weight": torch.randn(C, 3, p, p, generator=g, dtype=torch.float64) / math.sqrt(3 * p * p),
        "patch_embed.pos_emb.weight": 0.5
        * torch.randn(vc["init_pos_emb_height"], vc["init_pos_emb_width"], C, generator=g, dtype=torch.float64),
        "encoder.final_layernorm.weight": norm(C),
    }
    for i in range(vc["vt_num_hidden_layers"]):
        b = f"encoder.blocks.{i}."
        tower.update(
            {
                b + "norm0.weight": norm(C),
                b + "norm1.weight": norm(C),
                b + "wqkv.weight": lin(3 * qkv, C),
                b + "wo.weight": lin(C, qkv),
                b + "mlp.fc0.weight": lin(I, C),
                b + "mlp.fc1.weight": lin(C, I),
            }
        )
    projector = {
        "proj.0.weight": lin(k * C, k * C),
        "proj.2.weight": lin(text, k * C),
        "post_norm.weight": norm(text),
    }
    return tower, projector


# ---------------------------------------------------------------------------------------------------------------
# The float64 reference (Kimi K3's MoonViT3d + sd2_tpool + PatchMergerMLPV2), written from the architecture
# ---------------------------------------------------------------------------------------------------------------
def ref_rms_norm(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def ref_gelu_exact(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def ref_bilinear(table, out_h, out_w):
    """[H, W, C] -> [out_h, out_w, C], align_corners=False: source (dst + 0.5) in / out - 0.5, clamped at 0."""
    in_h, in_w, _ = table.shape

    def taps(dst, n_in, n_out):
        src = max((dst + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = min(int(math.floor(src)), n_in - 1)
        return i0, min(i0 + 1, n_in - 1), src - i0

    out = torch.empty(out_h, out_w, table.shape[-1], dtype=table.dtype)
    for r in range(out_h):
        r0, r1, fr = taps(r, in_h, out_h)
        for c in range(out_w):
            c0, c1, fc = taps(c, in_w, out_w)
            top = (1 - fc) * table[r0, c0] + fc * table[r0, c1]
            bottom = (1 - fc) * table[r1, c0] + fc * table[r1, c1]
            out[r, c] = (1 - fr) * top + fr * bottom
    return out


def ref_rotate(vec, row, col, theta=10000.0):
    """One head vector [hd]: complex slot j = (vec[2j], vec[2j+1]); slot 2i turns by col * freq_i, slot 2i+1 by
    row * freq_i, freq_i = theta^(-4i / hd)."""
    hd = vec.shape[0]
    out = vec.clone()
    for i in range(hd // 4):
        freq = theta ** (-4.0 * i / hd)
        for slot, pos in ((2 * i, col), (2 * i + 1, row)):
            a, b, ang = vec[2 * slot], vec[2 * slot + 1], pos * freq
            out[2 * slot] = a * math.cos(ang) - b * math.sin(ang)
            out[2 * slot + 1] = a * math.sin(ang) + b * math.cos(ang)
    return out


def ref_block(x, w, b, rows_cols, heads, hd, eps):
    n = x.shape[0]
    qkv = (ref_rms_norm(x, w[b + "norm0.weight"], eps) @ w[b + "wqkv.weight"].T).view(n, 3, heads, hd)
    attn = torch.empty(n, heads, hd, dtype=x.dtype)
    for h in range(heads):
        q = torch.stack([ref_rotate(qkv[t, 0, h], *rows_cols[t]) for t in range(n)])
        k = torch.stack([ref_rotate(qkv[t, 1, h], *rows_cols[t]) for t in range(n)])
        attn[:, h] = torch.softmax(q @ k.T / math.sqrt(hd), dim=-1) @ qkv[:, 2, h]  # no mask: the whole image
    x = x + attn.reshape(n, heads * hd) @ w[b + "wo.weight"].T
    hidden = ref_gelu_tanh(ref_rms_norm(x, w[b + "norm1.weight"], eps) @ w[b + "mlp.fc0.weight"].T)
    return x + hidden @ w[b + "mlp.fc1.weight"].T


def reference(vc, tower, projector, pixels, grid, eps=FP32_EPS):
    """-> (tower output [N, C] after the final norm, projector output [M, text hidden]), images only."""
    heads, layers = vc["vt_num_attention_heads"], vc["vt_num_hidden_layers"]
    hd = vc["qkv_hidden_size"] // heads
    kh, kw = vc["merge_kernel_size"]
    conv = tower["patch_embed.proj.weight"].flatten(1)
    table = tower["patch_embed.pos_emb.weight"]
    states, merged, start = [], [], 0
    for t, h, wd in grid.tolist():
        assert t == 1
        n = h * wd
        x = pixels[start : start + n].double().flatten(1) @ conv.T
        start += n
        pos = table if (h, wd) == tuple(table.shape[:2]) else ref_bilinear(table, h, wd)
        x = x + pos.reshape(n, -1)
        rows_cols = [(r, c) for r in range(h) for c in range(wd)]
        for i in range(layers):
            x = ref_block(x, tower, f"encoder.blocks.{i}.", rows_cols, heads, hd, eps)
        x = ref_rms_norm(x, tower["encoder.final_layernorm.weight"], eps)
        states.append(x)
        img = x.view(h, wd, -1)
        for R in range(h // kh):
            for Q in range(wd // kw):
                merged.append(torch.cat([img[kh * R + i, kw * Q + j] for i in range(kh) for j in range(kw)]))
    hidden = ref_gelu_exact(torch.stack(merged) @ projector["proj.0.weight"].T)
    out = ref_rms_norm(hidden @ projector["proj.2.weight"].T, projector["post_norm.weight"], vc["projector_ln_eps"])
    return torch.cat(states), out


def rename(names, pairs):
    """Apply the (regex source, target) pairs one after another, as transformers' renamings are applied."""
    out = {}
    for name in names:
        new = name
        for src, tgt in pairs:
            new = re.sub(src, tgt, new, count=1)
        out[name] = new
    return out


def k3_pair(seed=0):
    vc = dict(TINY_K3)
    tower, projector = released_tensors(vc, seed)
    config = KimiK3VisionConfig(**vc)
    model = KimiHybridVisionModel(config).eval()
    names = rename(tower, moonvit_key_mapping())
    model.load_state_dict({names[k]: v.float() for k, v in tower.items()}, strict=True)
    proj = build_multimodal_projector(config, vc["text_hidden_size"], layer_norm_eps=0.123).eval()
    proj.load_state_dict({k: v.float() for k, v in projector.items()}, strict=True)
    return vc, tower, projector, model, proj


def test_k3_tower_and_projector_match_the_float64_reference():
    vc, tower, projector, model, proj = k3_pair()
    pixels = torch.randn(int(GRID.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(1))
    want_states, want = reference(vc, tower, projector, pixels, GRID)
    with torch.no_grad():
        out = model(pixels, GRID)
        got = proj(out.pooler_output)
    assert out.last_hidden_state.dtype == torch.float32 and got.shape == want.shape == (
        int(GRID.prod(-1).sum()) // 4,
        48,
    )
    for a, b in ((out.last_hidden_state, want_states), (got, want)):
        rel = (a.double() - b).abs().max() / b.abs().max()
        assert rel <= 1e-5, rel
    # the interpolation mode is honoured: the same weights resampled bicubically miss the reference on image 2 only
    bicubic = KimiHybridVisionModel(KimiK3VisionConfig(**dict(vc, pos_emb_interpolation_mode="bicubic"))).eval()
    bicubic.load_state_dict(model.state_dict())
    with torch.no_grad():
        other = bicubic(pixels, GRID).last_hidden_state.double()
    assert (other[:64] - want_states[:64]).abs().max() <= 1e-5 * want_states.abs().max()
    assert (other[64:] - want_states[64:]).abs().max() > 1e-3 * want_states.abs().max()


def test_interleaved_rope_pair_order_on_a_hand_made_case():
    """head_dim 8: two frequencies (1, 10000^-1/2 = 0.01); complex slots [x0, y0, x1, y1] = real pairs
    (0,1), (2,3), (4,5), (6,7); x = column. (row 0, col 1) turns pairs 0 and 2; (row 1, col 0) pairs 1 and 3."""
    v = torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 0])[None, None]  # [N=1, heads=1, 8]
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    expected = {
        (0, 1): [c1, s1, 1, 0, c2, s2, 1, 0],
        (1, 0): [1, 0, c1, s1, 1, 0, c2, s2],
    }
    cos, sin = interleaved_rope([(1, 2, 2)], 8, 10000.0, "cpu")  # a 2 x 2 image: patch row * 2 + col (raster)
    rotated = apply_rope(v.expand(4, 1, 8), cos, sin, interleaved=True)
    for (row, col), want in expected.items():
        got = rotated[row * 2 + col, 0]
        assert torch.allclose(got, torch.tensor(want), atol=1e-6), (row, col, got)
        assert torch.allclose(ref_rotate(v[0, 0].double(), row, col).float(), torch.tensor(want), atol=1e-6)


def test_interleaved_layout_equals_axial_layout_with_permuted_rows():
    """The two RoPE layouts compute the same tower: K2.5's weights in transformers' names (axial, separate q/k/v)
    vs the same weights fused into qkv_proj with q/k rows in complex-pair order (what Moonshot's release stores)."""
    torch.manual_seed(0)
    axial = KimiHybridVisionModel(KimiHybridVisionConfig(**TINY_VISION)).eval()
    inter = KimiHybridVisionModel(
        KimiHybridVisionConfig(**TINY_VISION, rope_parameters={"rope_type": "interleaved_2d", "rope_theta": 1e4})
    ).eval()
    with torch.no_grad():
        for p in axial.parameters():
            p.normal_(0, 0.2)
    heads, sd = TINY_VISION["num_attention_heads"], {}
    # interleaved_to_half (the K2.5 converter's permutation) puts interleaved row perm[j] at rotate-half row j
    perm = interleaved_to_half(torch.arange(TINY_VISION["hidden_size"]), heads)
    half_to_interleaved = torch.argsort(perm)
    for k, v in axial.state_dict().items():
        m = re.match(r"(layers\.\d+\.attn\.)(q|k|v)_proj\.(weight|bias)", k)
        if m is None:
            sd[k] = v
            continue
        part = v if m.group(2) == "v" else v[half_to_interleaved]
        sd.setdefault(m.group(1) + "qkv_proj." + m.group(3), {})[m.group(2)] = part
    sd = {k: torch.cat([v["q"], v["k"], v["v"]]) if isinstance(v, dict) else v for k, v in sd.items()}
    inter.load_state_dict(sd, strict=True)
    grid = torch.tensor([[1, 8, 8], [1, 6, 10]])
    pv = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14)
    with torch.no_grad():
        a, b = axial(pv, grid).last_hidden_state, inter(pv, grid).last_hidden_state
    assert (a - b).abs().max() < 1e-5


def test_k3_names_map_by_renames_both_ways_with_transformers_renamings():
    """Released names -> ours through transformers' WeightRenaming (applied in turn, as from_pretrained does),
    exactly the tower's state dict; the reversed renamings write the released names back."""
    vc = dict(TINY_K3)
    tower, _ = released_tensors(vc)
    model = KimiHybridVisionModel(KimiK3VisionConfig(**vc))
    renamings = [WeightRenaming(src, tgt) for src, tgt in moonvit_key_mapping()]
    ours = {apply_renamings(k, renamings): v for k, v in tower.items()}
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert set(rename(tower, moonvit_key_mapping()).values()) == set(ours)
    back = [r.reverse_transform() for r in renamings]
    assert {apply_renamings(k, back) for k in model.state_dict()} == set(tower)


def test_full_size_k3_names_shapes_and_parameter_count():
    """The released config on the meta device: every released tensor (K3's 165 vision tensors, no biases) maps to
    a parameter of the same shape; ~401.2 M tower and ~46.1 M projector parameters."""
    config = KimiK3VisionConfig(**RELEASED)
    with torch.device("meta"):
        model = KimiHybridVisionModel(config)
        proj = build_multimodal_projector(config, config.text_hidden_size, 1e-5)
    released = {
        "patch_embed.proj.weight": (1024, 3, 14, 14),
        "patch_embed.pos_emb.weight": (64, 64, 1024),
        "encoder.final_layernorm.weight": (1024,),
    }
    for i in range(27):
        b = f"encoder.blocks.{i}."
        released.update(
            {
                b + "norm0.weight": (1024,),
                b + "norm1.weight": (1024,),
                b + "wqkv.weight": (4608, 1024),
                b + "wo.weight": (1024, 1536),
                b + "mlp.fc0.weight": (4096, 1024),
                b + "mlp.fc1.weight": (1024, 4096),
            }
        )
    assert len(released) == 165
    names = rename(released, moonvit_key_mapping())
    assert {names[k]: v for k, v in released.items()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in proj.state_dict().items()} == {
        "proj.0.weight": (4096, 4096),
        "proj.2.weight": (7168, 4096),
        "post_norm.weight": (7168,),
    }
    n_tower, n_proj = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in proj.parameters())
    assert round(n_tower / 1e6, 1) == 401.2 and round(n_proj / 1e6, 1) == 46.1
    norms = [model.layers[0].norm1, model.layers[0].norm2, model.final_layernorm]
    assert all(isinstance(m, torch.nn.RMSNorm) and m.eps is None for m in norms)  # finfo(dtype).eps at run time
    assert isinstance(proj, KimiHybridMultimodalProjectorV2) and proj.post_norm.eps == 1e-5
    assert isinstance(proj.proj[1], torch.nn.GELU) and proj.proj[1].approximate == "none"
    x = torch.linspace(-4, 4, 101)
    assert torch.allclose(model.layers[0].mlp.act(x), ref_gelu_tanh(x.double()).float(), atol=1e-6)  # tanh GELU


def test_released_config_round_trip(tmp_path):
    config = KimiK3VisionConfig(**RELEASED)
    assert (config.hidden_size, config.num_attention_heads, config.qkv_size(), config.intermediate_size) == (
        1024,
        12,
        1536,
        4096,
    )
    assert config._attn_implementation is None  # the release's flash_attention_2 is not forced
    written = config.to_dict()
    architecture = {k: v for k, v in RELEASED.items() if k != "_attn_implementation"}
    assert {k: written[k] for k in architecture} == architecture
    assert list(written)[: len(architecture)] == list(architecture)  # the release's order
    assert "rope_parameters" not in written and "hidden_size" not in written
    assert {k: v for k, v in KimiK3VisionConfig().to_dict().items() if k in architecture} == architecture
    again = KimiK3VisionConfig.from_dict(written)
    assert {k: again.to_dict()[k] for k in architecture} == architecture
    config.save_pretrained(tmp_path)
    loaded = KimiK3VisionConfig.from_pretrained(tmp_path)
    assert {k: loaded.to_dict()[k] for k in architecture} == architecture
    # the tiny release-spelled config builds and runs on CPU (eager / SDPA, never flash attention)
    model = KimiHybridVisionModel(KimiK3VisionConfig(**TINY_K3))
    assert model.config._attn_implementation in ("sdpa", "eager")


@pytest.mark.parametrize(
    "field,value",
    [
        ("merge_type", "sd2"),
        ("mlp_type", "swiglu"),
        ("pos_emb_type", "fixed"),
        ("projector_hidden_act", "gelu_pytorch_tanh"),
        ("activation_func", "gelu"),
        ("mm_projector_type", "linear"),
        ("norm_type", "batchnorm"),
        ("pos_emb_interpolation_mode", "nearest"),
        ("mm_hidden_size", 16),
        ("qkv_hidden_size", 60),
        ("vt_hidden_size", "wide"),
        ("some_new_field", 1),
    ],
)
def test_k3_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KimiK3VisionConfig(**dict(TINY_K3, **{field: value}))


def test_k25_defaults_and_projector_unchanged():
    default = KimiHybridVisionConfig()
    assert (
        default.norm_type,
        default.rms_norm_eps,
        default.attention_bias,
        default.mlp_bias,
        default.patch_embed_bias,
        default.qkv_hidden_size,
        default.pos_emb_interpolation_mode,
        default.rope_parameters["rope_type"],
        default.projector_type,
        default.projector_layer_norm_eps,
    ) == ("layernorm", None, True, True, True, None, "bicubic", "axial", "patchmerger", None)
    config = KimiHybridVisionConfig(**TINY_VISION)
    proj = build_multimodal_projector(config, 48, layer_norm_eps=1e-6)
    assert type(proj) is KimiHybridMultimodalProjector and proj.pre_norm.eps == 1e-6
    assert set(proj.state_dict()) == {
        f"{m}.{p}" for m in ("pre_norm", "in_proj", "out_proj") for p in ("weight", "bias")
    }
    with pytest.raises(ValueError, match="KimiK3VisionConfig"):  # Moonshot's spelling would build K2.5's tower
        KimiHybridVisionConfig(vt_hidden_size=32)
    with pytest.raises(ValueError, match="rope_type"):
        KimiHybridVisionConfig(rope_parameters={"rope_type": "mrope"})
    with pytest.raises(ValueError, match="projector_type"):
        KimiHybridVisionConfig(projector_type="mlp")


def test_k3_tower_records_outputs_and_checkpoints_gradients():
    """K3 mode keeps the tower's conventions: output_hidden_states / output_attentions (block-diagonal) and
    gradient checkpointing giving the same gradients."""
    _, _, _, model, _ = k3_pair()
    pv = torch.randn(int(GRID.prod(-1).sum()), 3, 14, 14)
    with torch.no_grad():
        out = model(pv, GRID, output_hidden_states=True, output_attentions=True)
    n = int(GRID.prod(-1).sum())
    assert len(out.hidden_states) == 3 and len(out.attentions) == 2
    assert out.attentions[0].shape == (1, 2, n, n) and out.attentions[0][..., :64, 64:].abs().max() == 0
    model.train()
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        if ckpt:
            model.activation_checkpointing_enable()
        model(pv, GRID).pooler_output.square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_saved_k3_tower_reloads_through_the_base_classes(tmp_path):
    """A saved K3 tower's config.json (model_type kimi_k3_vision, the release's spelling) read through
    KimiHybridVisionConfig -- KimiHybridVisionModel.from_pretrained, a composite config's vision_config -- builds
    KimiK3VisionConfig; the weights come back equal."""
    _, _, _, model, _ = k3_pair()
    model.save_pretrained(tmp_path / "tower")
    assert '"vt_hidden_size": 32' in (tmp_path / "tower" / "config.json").read_text()
    loaded = KimiHybridVisionModel.from_pretrained(tmp_path / "tower")
    assert type(loaded.config) is KimiK3VisionConfig and loaded.config.qkv_size() == 64
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert type(KimiHybridVisionConfig.from_dict(KimiK3VisionConfig().to_dict())) is KimiK3VisionConfig
    composite = KimiHybridConfig(text_config=dict(TINY), vision_config=KimiK3VisionConfig(**TINY_K3), image_token_id=7)
    composite.save_pretrained(tmp_path / "composite")
    again = KimiHybridConfig.from_pretrained(tmp_path / "composite").vision_config
    assert type(again) is KimiK3VisionConfig and again.to_dict()["vt_hidden_size"] == 32


def test_moonvit_name_table_gives_both_directions():
    """One declaration (MOONVIT_NAMES) -> the load-time renames and the save's reverse renames, inverse of each
    other on every entry (block index 7 standing for any)."""
    import re

    from kimi_hf.models.kimi_hybrid.conversion_mapping_kimi_hybrid import MOONVIT_NAMES, rename_pairs

    def apply(pairs, name):
        for src, tgt in pairs:
            if re.match(src, name):
                return re.sub(src, tgt, name, count=1)
        return name

    forward, back = rename_pairs(MOONVIT_NAMES), rename_pairs(MOONVIT_NAMES, reverse=True)
    assert forward == moonvit_key_mapping()
    for released, ours in MOONVIT_NAMES:
        r, o = released.replace("{i}", "7") + "weight", ours.replace("{i}", "7") + "weight"
        assert apply(forward, r) == o and apply(back, o) == r
    assert apply(forward, "patch_embed.proj.weight") == "patch_embed.proj.weight"  # a same-name tensor
