"""KimiHybridVisionModel: weight-compatible with transformers' kimi_k25 vision tower (same state dict,
same outputs, same recorded hidden states; attention weights equal to the ones inside kimi_k25's eager
attention), per-image attention, gradient checkpointing, input validation; the configs."""

import pytest
import torch
from transformers import AutoConfig, AutoModel
from transformers.models.kimi_k25 import modeling_kimi_k25 as k25_modeling
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config, Kimi_K25VisionConfig
from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

from kimi_hf import KimiHybridConfig, KimiHybridVisionConfig, KimiHybridVisionModel
from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid_vision import KimiHybridMultimodalProjector

from .helpers import TINY, TINY_VISION


GRID = torch.tensor([[1, 8, 8], [1, 6, 10], [1, 4, 4]])  # the table's own size, a non-square resample, a small one


def pixels(grid, seed=0):
    return torch.randn(int(grid.prod(-1).sum()), 3, 14, 14, generator=torch.Generator().manual_seed(seed))


def k25_pair():
    """A kimi_k25 tower with random weights and ours loaded from its state dict."""
    torch.manual_seed(0)
    ref = Kimi_K25VisionModel(
        Kimi_K25VisionConfig(**TINY_VISION, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    )
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ours = KimiHybridVisionModel(KimiHybridVisionConfig(**TINY_VISION))
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    return ref.eval(), ours.eval()


def test_matches_transformers_kimi_k25_tower_and_projector():
    ref, ours = k25_pair()
    assert set(ref.state_dict()) == set(ours.state_dict())
    pv = pixels(GRID)
    with torch.no_grad():
        a, b = ref(pv, grid_thw=GRID), ours(pv, GRID)
    assert (a.last_hidden_state - b.last_hidden_state).abs().max() < 1e-5
    assert a.pooler_output.shape == b.pooler_output.shape == (int(GRID.prod(-1).sum()) // 4, 4, 32)
    assert (a.pooler_output - b.pooler_output).abs().max() < 1e-5
    # the projector: same names, same output
    k25 = Kimi_K25Config(
        text_config={"model_type": "deepseek_v3", "hidden_size": 48},
        vision_config=TINY_VISION,
        projection_hidden_size=32,
    )
    ref_proj, our_proj = Kimi_K25MultimodalProjection(k25), KimiHybridMultimodalProjector(32, 4, 48)
    our_proj.load_state_dict(ref_proj.state_dict(), strict=True)
    with torch.no_grad():
        assert torch.allclose(ref_proj(a.pooler_output).squeeze(1), our_proj(b.pooler_output), atol=1e-5)


def test_images_attend_only_to_themselves():
    _, ours = k25_pair()
    pv = pixels(GRID)
    changed = pv.clone()
    changed[64:] += 1.0  # images 2 and 3
    with torch.no_grad():
        a, b = ours(pv, GRID).last_hidden_state, ours(changed, GRID).last_hidden_state
    assert torch.allclose(a[:64], b[:64], atol=1e-6) and not torch.allclose(a[64:], b[64:])
    with torch.no_grad():  # alone or in a batch: the same
        alone = ours(pv[:64], GRID[:1]).last_hidden_state
    assert torch.allclose(alone, a[:64], atol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    _, ours = k25_pair()
    ours.train()
    pv = pixels(GRID[:2])
    grads = []
    for ckpt in (False, True):
        ours.zero_grad()
        if ckpt:
            ours.activation_checkpointing_enable()
        ours(pv, GRID[:2]).pooler_output.square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in ours.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


@pytest.mark.parametrize(
    "grid,match",
    [
        (torch.tensor([[1, 3, 4]]), "divisible"),
        (torch.tensor([[1, 4, 4]]), "describes"),
        (torch.tensor([1, 4, 4]), "image_grid_thw"),
    ],
)
def test_bad_grids_raise(grid, match):
    _, ours = k25_pair()
    with pytest.raises(ValueError, match=match):
        ours(pixels(torch.tensor([[1, 2, 2]])), grid)


def test_configs_validate_and_round_trip(tmp_path):
    with pytest.raises(ValueError, match="merge_kernel_size"):
        KimiHybridVisionConfig(merge_kernel_size=[2])
    with pytest.raises(ValueError, match="divisible by 4"):
        KimiHybridVisionConfig(hidden_size=36, num_attention_heads=6)
    with pytest.raises(ValueError, match="image_token_id"):
        KimiHybridConfig(text_config=dict(TINY), vision_config=TINY_VISION, image_token_id=500)
    default = KimiHybridVisionConfig()  # K2.5's tower
    assert (default.hidden_size, default.num_hidden_layers, default.patch_size, default.intermediate_size) == (
        1152,
        27,
        14,
        4304,
    )
    cfg = KimiHybridConfig(
        text_config=dict(TINY), vision_config=KimiHybridVisionConfig(**TINY_VISION), image_token_id=7
    )
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, KimiHybridConfig) and loaded.vision_config.hidden_size == 32
    assert loaded.text_config.vocab_size == TINY["vocab_size"] and loaded.image_token_id == 7
    assert isinstance(AutoModel.from_config(loaded.vision_config), KimiHybridVisionModel)


def test_hidden_states_are_recorded_like_transformers_kimi_k25():
    """output_hidden_states: the patch embeddings, then every layer's output, the last one after the final
    LayerNorm (= last_hidden_state): num_hidden_layers + 1 states [N, D], each equal to kimi_k25's (max abs
    diff <= 1e-5 of the state's max abs value: the pre-LayerNorm states reach ~20, fp32 rounding of the
    conv vs matmul patch embedding and the two bicubic resamplings gives ~2e-5 there)."""
    ref, ours = k25_pair()
    pv = pixels(GRID)
    n = int(GRID.prod(-1).sum())
    with torch.no_grad():
        a = ref(pv, grid_thw=GRID, output_hidden_states=True)
        b = ours(pv, GRID, output_hidden_states=True)
        plain = ours(pv, GRID)
    assert plain.hidden_states is None and plain.attentions is None  # recorded only when asked
    assert len(b.hidden_states) == len(a.hidden_states) == TINY_VISION["num_hidden_layers"] + 1
    for x, y in zip(a.hidden_states, b.hidden_states):
        assert y.shape == (n, TINY_VISION["hidden_size"])
        assert (x - y).abs().max() <= 1e-5 * x.abs().max()
    assert torch.equal(b.hidden_states[-1], b.last_hidden_state)
    assert (b.last_hidden_state - plain.last_hidden_state).abs().max() < 1e-6


def attention_reference(ref, pv, grid):
    """Per layer, the block-diagonal [1, heads, N, N] attention weights of transformers' kimi_k25 tower, read
    from its eager attention (kimi_k25's own `attentions` output records the attention outputs, not weights)."""
    blocks = []

    def recording(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, w = original(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
        blocks.append(w)
        return out, w

    original = k25_modeling.eager_attention_forward
    ref.set_attn_implementation("eager")
    k25_modeling.eager_attention_forward = recording
    try:
        with torch.no_grad():
            ref(pv, grid_thw=grid)
    finally:
        k25_modeling.eager_attention_forward = original
    per_layer, n, heads = len(grid), int(grid.prod(-1).sum()), TINY_VISION["num_attention_heads"]
    layers = []
    for i in range(0, len(blocks), per_layer):
        full = torch.zeros(1, heads, n, n)
        start = 0
        for w in blocks[i : i + per_layer]:
            full[..., start : start + w.shape[-1], start : start + w.shape[-1]] = w
            start += w.shape[-1]
        layers.append(full)
    return layers


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_attention_weights_are_recorded_per_layer_and_match_kimi_k25(attn_implementation):
    """output_attentions: one [1, heads, N, N] tensor per layer, block-diagonal (an image attends to itself
    only), equal (1e-5) to the softmax weights inside kimi_k25's tower; rows sum to 1; also with SDPA
    configured (the weights come from the eager path then), and the outputs stay the same (1e-5)."""
    ref, ours = k25_pair()
    ours.set_attn_implementation(attn_implementation)
    pv = pixels(GRID)
    expected = attention_reference(ref, pv, GRID)
    with torch.no_grad():
        out = ours(pv, GRID, output_attentions=True, output_hidden_states=True)
        plain = ours(pv, GRID)
    n = int(GRID.prod(-1).sum())
    assert len(out.attentions) == len(expected) == TINY_VISION["num_hidden_layers"]
    assert len(out.hidden_states) == TINY_VISION["num_hidden_layers"] + 1
    for got, want in zip(out.attentions, expected):
        assert got.shape == (1, TINY_VISION["num_attention_heads"], n, n)
        assert (got - want).abs().max() < 1e-5
        assert torch.allclose(got.sum(-1), torch.ones(1, TINY_VISION["num_attention_heads"], n), atol=1e-5)
        assert got[..., :64, 64:].abs().max() == 0 and got[..., 64:, :64].abs().max() == 0
    assert (out.last_hidden_state - plain.last_hidden_state).abs().max() < 1e-5
    assert (out.pooler_output - plain.pooler_output).abs().max() < 1e-5
    as_tuple = ours(pv, GRID, output_attentions=True, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple[-1]) == TINY_VISION["num_hidden_layers"]
