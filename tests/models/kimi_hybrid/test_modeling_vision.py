"""KimiHybridVisionModel: weight-compatible with transformers' kimi_k25 vision tower (same state dict,
same outputs), per-image attention, gradient checkpointing, input validation; the configs."""

import pytest
import torch
from transformers import AutoConfig, AutoModel
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
    ref = Kimi_K25VisionModel(Kimi_K25VisionConfig(**TINY_VISION, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}))
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
    k25 = Kimi_K25Config(text_config={"model_type": "deepseek_v3", "hidden_size": 48}, vision_config=TINY_VISION,
                         projection_hidden_size=32)
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
            ours.gradient_checkpointing_enable()
        ours(pv, GRID[:2]).pooler_output.square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in ours.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


@pytest.mark.parametrize("grid,match", [
    (torch.tensor([[1, 3, 4]]), "divisible"),
    (torch.tensor([[1, 4, 4]]), "describes"),
    (torch.tensor([1, 4, 4]), "image_grid_thw"),
])
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
    assert (default.hidden_size, default.num_hidden_layers, default.patch_size, default.intermediate_size) == (1152, 27, 14, 4304)
    cfg = KimiHybridConfig(text_config=dict(TINY), vision_config=KimiHybridVisionConfig(**TINY_VISION), image_token_id=7)
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, KimiHybridConfig) and loaded.vision_config.hidden_size == 32
    assert loaded.text_config.vocab_size == TINY["vocab_size"] and loaded.image_token_id == 7
    assert isinstance(AutoModel.from_config(loaded.vision_config), KimiHybridVisionModel)
