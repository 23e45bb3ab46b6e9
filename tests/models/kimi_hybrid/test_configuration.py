"""KimiHybridTextConfig: the three spellings of Kimi Linear's config, defaults, validation, Auto classes."""

import re

import pytest
from transformers import AutoConfig

from kimi_hf import KimiHybridTextConfig
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import kimi_linear_layer_types

from .helpers import TINY, tiny_config


def test_default_is_kimi_linear_48b_layout():
    cfg = KimiHybridTextConfig()
    full = [i + 1 for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [4, 8, 12, 16, 20, 24, 27]
    assert cfg.mlp_layer_types[0] == "dense" and set(cfg.mlp_layer_types[1:]) == {"sparse"}
    assert cfg.qk_head_dim == 192 and cfg.kv_lora_rank == 512


def test_reads_moonshot_original_config():
    moonshot = dict(
        TINY,
        num_hidden_layers=5,
        num_experts=8,
        num_experts_per_token=3,
        num_shared_experts=2,
        moe_renormalize=False,
        first_k_dense_replace=2,
        model_max_length=4096,
        linear_attn_config={
            "kda_layers": [1, 2, 4, 5],
            "full_attn_layers": [3],
            "head_dim": 16,
            "num_heads": 3,
            "short_conv_kernel_size": 3,
        },
    )
    del moonshot["num_experts_per_tok"], moonshot["n_shared_experts"]
    cfg = KimiHybridTextConfig(**moonshot)
    assert cfg.layer_types == [
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
    ]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (8, 3, 2)
    assert cfg.norm_topk_prob is False and cfg.max_position_embeddings == 4096
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (16, 3, 3)
    assert cfg.mlp_layer_types == ["dense", "dense", "sparse", "sparse", "sparse"]


def test_reads_native_transformers_fields():
    native = dict(
        TINY,
        num_local_experts=6,
        n_group=2,
        topk_group=1,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 3,
    )
    del native["num_experts"]
    cfg = KimiHybridTextConfig(**native)
    assert cfg.num_experts == 6 and cfg.num_local_experts == 6 and cfg.n_group == 2


def test_save_load_and_auto_config(tmp_path):
    cfg = tiny_config()
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, KimiHybridTextConfig)
    assert loaded.to_diff_dict() == {**cfg.to_diff_dict(), "_name_or_path": str(tmp_path)} or loaded.to_json_string(
        use_diff=True
    ) == cfg.to_json_string(use_diff=True)
    assert isinstance(AutoConfig.for_model("kimi_hybrid_text"), KimiHybridTextConfig)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(layer_types=["linear_attention"] * 3 + ["mamba"]), "layer_types"),
        (dict(mlp_layer_types=["dense"] * 3 + ["moe"]), "mlp_layer_types"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(qk_nope_head_dim=0), "qk_nope_head_dim"),
        (dict(linear_head_dim=-8), "linear_head_dim"),
        (dict(q_lora_rank=0), "q_lora_rank"),
        (dict(n_group=3), "n_group"),
        (dict(n_group=2, topk_group=3), "topk_group"),
        (dict(num_key_value_heads=1), "num_key_value_heads"),
        (dict(mla_use_nope=False), "mla_use_nope"),
        (dict(bos_token_id=-1), "bos_token_id"),
        (dict(eos_token_id=[2, "3"]), "eos_token_id"),
        (
            dict(linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [9]}, layer_types=None),
            "linear_attn_config",
        ),
    ],
)
def test_invalid_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_a_token_id_outside_the_vocabulary_is_refused_by_the_model():
    from kimi_hf import KimiHybridForCausalLM

    for field, value in (("pad_token_id", 97), ("eos_token_id", [2, 200])):  # vocab_size 97: ids 0..96
        config = tiny_config(**{field: value})
        with pytest.raises(ValueError, match=re.escape(f"{field} = {value!r} is not a token id of the vocabulary")):
            KimiHybridForCausalLM(config)


def test_layer_pattern_helper():
    assert kimi_linear_layer_types(6) == ["linear_attention"] * 3 + [
        "full_attention",
        "linear_attention",
        "full_attention",
    ]


def test_small_vocabulary_with_kimi_default_token_ids_raises_a_value_error():
    """Issue: KimiHybridTextConfig(vocab_size=512, ...) kept Kimi's ids (163839, ...) and nn.Embedding asserted.
    The model refuses them by name; the config alone builds (transformers sets fields after construction)."""
    from kimi_hf import KimiHybridForCausalLM

    small = KimiHybridTextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"pad_token_id = 163839 \(the default.*vocab_size 512"):
        KimiHybridForCausalLM(small)
    small.pad_token_id, small.bos_token_id = None, 1
    with pytest.raises(ValueError, match=r"eos_token_id = 163586 \(the default"):
        small.check_token_ids()
    cfg = KimiHybridTextConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, pad_token_id=None, bos_token_id=1, eos_token_id=[2, 3]
    )
    assert cfg.pad_token_id is None and cfg.eos_token_id == [2, 3]
