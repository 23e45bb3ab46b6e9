"""state_dict_kimi_k3: K3's released-layout adapter in its own module (public names for what other modules use), still
importable from modeling_kimi_k3, and shipped in saved folders next to the modeling file that imports it."""

from __future__ import annotations

import torch

from kimi_hf.models import hub_kimi
from kimi_hf.models.kimi_k3 import modeling_kimi_k3, state_dict_kimi_k3


PUBLIC = (
    "RELEASED_PREFIXES",
    "SAVED_EXPERTS",
    "check_mxfp4_headers",
    "k3_state_dict",
    "load_k3_state_dict",
    "released_key_mapping",
    "released_name",
)


def test_the_adapter_lives_in_its_module_and_the_old_paths_still_work():
    assert sorted(state_dict_kimi_k3.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(modeling_kimi_k3, name) is getattr(state_dict_kimi_k3, name), name
    for name in ("check_mxfp4_headers", "k3_state_dict", "load_k3_state_dict", "released_name"):
        assert getattr(state_dict_kimi_k3, name).__module__ == state_dict_kimi_k3.__name__, name
    # the conversion itself is no longer defined in the modeling file
    assert not hasattr(modeling_kimi_k3, "_k3_state_dict") and not hasattr(modeling_kimi_k3, "_released_name")


def test_released_name():
    sparse = {1}
    assert state_dict_kimi_k3.released_name("model.language_model.layers.1.mlp.experts.gate_up_proj", sparse) == (
        "language_model.model.layers.1.block_sparse_moe.experts.gate_up_proj",
        None,
    )
    assert state_dict_kimi_k3.released_name("model.language_model.layers.0.mlp.down_proj.weight", sparse) == (
        "language_model.model.layers.0.mlp.down_proj.weight",
        None,
    )
    assert state_dict_kimi_k3.released_name("model.language_model.layers.0.attn_res.query", sparse) == (
        "language_model.model.layers.0.self_attention_res_proj.weight",
        (1, -1),
    )
    assert state_dict_kimi_k3.released_name("lm_head.weight", sparse) == ("language_model.lm_head.weight", None)


def test_saved_k3_folders_ship_the_adapter(tmp_path):
    from kimi_hf import KimiK3ForConditionalGeneration
    from kimi_hf.presets import small_k3_config

    assert "state_dict_kimi_k3.py" in hub_kimi.import_closure(hub_kimi.model_modules("kimi_k3"))
    config = small_k3_config(64, 4, vocab_size=100, media_token_id=99, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    KimiK3ForConditionalGeneration(config).save_pretrained(tmp_path)
    saved = (tmp_path / "state_dict_kimi_k3.py").read_text()
    assert "def k3_state_dict(" in saved and "from .conversion_mapping_kimi_k3 import" in saved  # flattened
    assert "from .state_dict_kimi_k3 import" in (tmp_path / "modeling_kimi_k3.py").read_text()
