"""Self-tests of the K3 test infrastructure: the release-format writer and the fp64 reference.

The expected tensor table below is written by hand from the K3 tensor inventory (§4.2) for the tiny default
config, independently of the writer's own spec code.
"""

import json
import math
import os
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from . import reference as ref
from .release_format import (
    dequantize_mxfp4,
    e2m1_decode,
    k3_layer_lists,
    mxfp4_from_codes,
    pack_mxfp4,
    tiny_k3_config,
    unpack_mxfp4_codes,
    write_k3_checkpoint,
)


LM = "language_model.model."

# ---------------------------------------------------------------------------------------------------------------
# Hand-written inventory for tiny_k3_config(): hidden 96, 7 layers, KDA 2x32, MLA 2 heads (q_lora 32, kv_lora 32,
# nope 16, rope 8, v 16), dense 128, 8 experts, latent 64, moe_intermediate 96, 2 shared, vocab 320,
# ViT 32 wide / qkv 64 / mlp 64 / 2 blocks, pos emb 8x8, projector 128 -> 96.
# ---------------------------------------------------------------------------------------------------------------

KDA_LAYERS_0B = (0, 1, 2, 4)  # 1-based kda_layers [1, 2, 3, 5]
MLA_LAYERS_0B = (3, 5, 6)  # 1-based full_attn_layers [4, 6, 7]: the last two layers are MLA
DENSE_LAYERS = (0,)  # first_k_dense_replace 1
NUM_EXPERTS = 8

BF16, F32, U8 = "BF16", "F32", "U8"

ALL_LAYERS = {
    "input_layernorm.weight": (BF16, [96]),
    "post_attention_layernorm.weight": (BF16, [96]),
    "self_attention_res_norm.weight": (BF16, [96]),
    "self_attention_res_proj.weight": (BF16, [1, 96]),
    "mlp_res_norm.weight": (BF16, [96]),
    "mlp_res_proj.weight": (BF16, [1, 96]),
}
KDA = {
    "self_attn.q_proj.weight": (BF16, [64, 96]),
    "self_attn.k_proj.weight": (BF16, [64, 96]),
    "self_attn.v_proj.weight": (BF16, [64, 96]),
    "self_attn.q_conv1d.weight": (F32, [64, 1, 4]),
    "self_attn.k_conv1d.weight": (F32, [64, 1, 4]),
    "self_attn.v_conv1d.weight": (F32, [64, 1, 4]),
    "self_attn.f_a_proj.weight": (BF16, [32, 96]),
    "self_attn.f_b_proj.weight": (BF16, [64, 32]),
    "self_attn.b_proj.weight": (BF16, [2, 96]),
    "self_attn.A_log": (F32, [32]),
    "self_attn.dt_bias": (F32, [64]),
    "self_attn.g_proj.weight": (BF16, [64, 96]),
    "self_attn.o_norm.weight": (F32, [32]),
    "self_attn.o_proj.weight": (BF16, [96, 64]),
}
MLA = {
    "self_attn.q_a_proj.weight": (BF16, [32, 96]),
    "self_attn.q_a_layernorm.weight": (BF16, [32]),
    "self_attn.q_b_proj.weight": (BF16, [48, 32]),
    "self_attn.kv_a_proj_with_mqa.weight": (BF16, [40, 96]),
    "self_attn.kv_a_layernorm.weight": (BF16, [32]),
    "self_attn.kv_b_proj.weight": (BF16, [64, 32]),
    "self_attn.g_proj.weight": (BF16, [32, 96]),
    "self_attn.o_proj.weight": (BF16, [96, 32]),
}
DENSE = {
    "mlp.gate_proj.weight": (BF16, [128, 96]),
    "mlp.up_proj.weight": (BF16, [128, 96]),
    "mlp.down_proj.weight": (BF16, [96, 128]),
}
MOE = {
    "block_sparse_moe.gate.weight": (BF16, [8, 96]),
    "block_sparse_moe.gate.e_score_correction_bias": (F32, [8]),
    "block_sparse_moe.shared_experts.gate_proj.weight": (BF16, [192, 96]),
    "block_sparse_moe.shared_experts.up_proj.weight": (BF16, [192, 96]),
    "block_sparse_moe.shared_experts.down_proj.weight": (BF16, [96, 192]),
    "block_sparse_moe.routed_expert_down_proj.weight": (BF16, [64, 96]),
    "block_sparse_moe.routed_expert_norm.weight": (BF16, [64]),
    "block_sparse_moe.routed_expert_up_proj.weight": (BF16, [96, 64]),
}
EXPERT_MXFP4 = {
    "w1.weight_packed": (U8, [96, 32]),
    "w1.weight_scale": (U8, [96, 2]),
    "w3.weight_packed": (U8, [96, 32]),
    "w3.weight_scale": (U8, [96, 2]),
    "w2.weight_packed": (U8, [64, 48]),
    "w2.weight_scale": (U8, [64, 3]),
}
EXPERT_PLAIN = {
    "w1.weight": (BF16, [96, 64]),
    "w3.weight": (BF16, [96, 64]),
    "w2.weight": (BF16, [64, 96]),
}
MODEL_LEVEL = {
    "language_model.model.embed_tokens.weight": (BF16, [320, 96]),
    "language_model.model.norm.weight": (BF16, [96]),
    "language_model.model.output_attn_res_norm.weight": (BF16, [96]),
    "language_model.model.output_attn_res_proj.weight": (BF16, [1, 96]),
    "language_model.lm_head.weight": (BF16, [320, 96]),
}
VISION_BLOCK = {
    "norm0.weight": (BF16, [32]),
    "norm1.weight": (BF16, [32]),
    "wqkv.weight": (BF16, [192, 32]),
    "wo.weight": (BF16, [32, 64]),
    "mlp.fc0.weight": (BF16, [64, 32]),
    "mlp.fc1.weight": (BF16, [32, 64]),
}
VISION_AND_PROJECTOR = {
    "vision_tower.patch_embed.proj.weight": (BF16, [32, 3, 14, 14]),
    "vision_tower.patch_embed.pos_emb.weight": (BF16, [8, 8, 32]),
    "vision_tower.encoder.final_layernorm.weight": (BF16, [32]),
    "mm_projector.proj.0.weight": (BF16, [128, 128]),
    "mm_projector.proj.2.weight": (BF16, [96, 128]),
    "mm_projector.post_norm.weight": (BF16, [96]),
}


def expected_inventory(mxfp4: bool = True, float32: bool = False) -> dict[str, tuple[str, list[int]]]:
    table: dict[str, tuple[str, list[int]]] = {}
    for layer in range(7):
        p = f"{LM}layers.{layer}."
        parts = [ALL_LAYERS, KDA if layer in KDA_LAYERS_0B else MLA, DENSE if layer in DENSE_LAYERS else MOE]
        for part in parts:
            table.update({p + k: v for k, v in part.items()})
        if layer not in DENSE_LAYERS:
            for e in range(NUM_EXPERTS):
                experts = EXPERT_MXFP4 if mxfp4 else EXPERT_PLAIN
                table.update({f"{p}block_sparse_moe.experts.{e}.{k}": v for k, v in experts.items()})
    table.update(MODEL_LEVEL)
    table.update(VISION_AND_PROJECTOR)
    for i in range(2):
        table.update({f"vision_tower.encoder.blocks.{i}.{k}": v for k, v in VISION_BLOCK.items()})
    if float32:
        table = {k: (F32 if d == BF16 else d, s) for k, (d, s) in table.items()}
    return table


_DTYPE_NAMES = {torch.bfloat16: BF16, torch.float32: F32, torch.uint8: U8}


def read_checkpoint(folder: str) -> dict[str, torch.Tensor]:
    """All stored tensors of a sharded checkpoint, by name (asserting no name appears in two shards)."""
    out: dict[str, torch.Tensor] = {}
    for file_name in sorted(os.listdir(folder)):
        if file_name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file_name), framework="pt") as f:
                for name in f.keys():
                    assert name not in out, f"{name} is stored twice"
                    out[name] = f.get_tensor(name)
    return out


def numpy_mxfp4_decode(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A second, numpy-only MXFP4 decoder (§4.3), to check the stored bytes against the returned logical tensors."""
    lut = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.int64)
    codes[:, 0::2] = packed & 0xF
    codes[:, 1::2] = packed >> 4
    values = lut[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    return values * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------

RELEASE_QUANT_JSON = r"""
{"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
 "global_compression_ratio": null, "kv_cache_scheme": null,
 "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": null,
   "output_activations": null,
   "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": true,
     "dynamic": false, "scale_dtype": "torch.uint8", "zp_dtype": null, "observer": "minmax", "observer_kwargs": {},
     "actorder": null, "block_structure": null}}},
 "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
   "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}
"""

TEXT_ARCH_FIELDS = """vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads intermediate_size
hidden_act activation_situ_beta activation_situ_linear_beta rms_norm_eps initializer_range max_position_embeddings
q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim mla_use_nope mla_use_output_gate
linear_attn_config attn_res_block_size first_k_dense_replace moe_layer_freq num_experts num_experts_per_token
num_shared_experts moe_intermediate_size routed_expert_hidden_size latent_moe_use_norm moe_router_activation_func
moe_renormalize routed_scaling_factor use_grouped_topk num_expert_group topk_group topk_method
num_nextn_predict_layers tie_word_embeddings use_cache bos_token_id eos_token_id pad_token_id dtype
transformers_version quantization_config architectures auto_map model_type""".split()

VISION_FIELDS = """_attn_implementation patch_size init_pos_emb_height init_pos_emb_width init_pos_emb_time pos_emb_type
pos_emb_interpolation_mode vt_hidden_size vt_num_hidden_layers vt_num_attention_heads qkv_hidden_size
vt_intermediate_size norm_type attn_bias linear_bias patch_embed_proj_bias mlp_type activation_func merge_kernel_size
merge_type mm_projector_type mm_hidden_size projector_hidden_act projector_ln_eps text_hidden_size""".split()


def test_tiny_config_is_shaped_like_the_release(k3_config):
    c = k3_config
    assert set(c) == {
        "architectures", "auto_map", "model_type", "dtype", "bos_token_id", "eos_token_id", "pad_token_id",
        "ignore_index", "media_placeholder_token_id", "image_placeholder", "tie_word_embeddings", "text_config",
        "vision_config",
    }  # fmt: skip
    assert c["architectures"] == ["KimiK3ForConditionalGeneration"] and c["model_type"] == "kimi_k3"
    assert c["image_placeholder"] == "<|kimi_image_placeholder|>" and c["tie_word_embeddings"] is False
    t = c["text_config"]
    assert t["model_type"] == "kimi_linear" and t["architectures"] == ["KimiLinearForCausalLM"]
    assert set(TEXT_ARCH_FIELDS) <= set(t)
    assert "head_dim" not in t and "rope_theta" not in t and "rope_scaling" not in t  # not in the raw release
    assert t["hidden_act"] == "situ" and t["mla_use_nope"] is True and t["num_nextn_predict_layers"] == 0
    assert t["quantization_config"] == json.loads(RELEASE_QUANT_JSON)
    assert t["linear_attn_config"] == {
        "num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4, "use_full_rank_gate": True,
        "gate_lower_bound": -5.0, "full_attn_layers": [4, 6, 7], "kda_layers": [1, 2, 3, 5],
    }  # fmt: skip
    assert set(c["vision_config"]) == set(VISION_FIELDS)
    assert c["vision_config"]["text_hidden_size"] == t["hidden_size"]
    vocab = t["vocab_size"]
    for ids in (c, t):
        assert all(0 <= ids[k] < vocab for k in ("bos_token_id", "eos_token_id", "pad_token_id"))
    assert 0 <= c["media_placeholder_token_id"] < vocab
    assert len({c["bos_token_id"], c["eos_token_id"], c["pad_token_id"], c["media_placeholder_token_id"]}) == 4


def test_config_overrides():
    c = tiny_k3_config(
        num_hidden_layers=5, linear_attn_config={"gate_lower_bound": None}, vision={"vt_num_hidden_layers": 1}
    )
    lac = c["text_config"]["linear_attn_config"]
    assert lac["full_attn_layers"] == [4, 5] and lac["kda_layers"] == [1, 2, 3] and lac["gate_lower_bound"] is None
    assert lac["head_dim"] == 32  # merged, not replaced
    assert c["vision_config"]["vt_num_hidden_layers"] == 1
    assert tiny_k3_config(hidden_size=64)["vision_config"]["text_hidden_size"] == 64
    assert "quantization_config" not in tiny_k3_config(quantization_config=None)["text_config"]
    with pytest.raises(KeyError):
        tiny_k3_config(num_expert=4)
    assert k3_layer_lists(8) == ([1, 2, 3, 5, 6], [4, 7, 8])


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint files
# ---------------------------------------------------------------------------------------------------------------


def _inventory(stored: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    return {k: (_DTYPE_NAMES[v.dtype], list(v.shape)) for k, v in stored.items()}


def test_names_shapes_dtypes_match_the_release_table(k3_checkpoint):
    stored = read_checkpoint(k3_checkpoint.folder)
    expected = expected_inventory(mxfp4=True)
    assert set(stored) - set(expected) == set(), "unexpected tensors"
    assert set(expected) - set(stored) == set(), "missing tensors"
    assert _inventory(stored) == expected


@pytest.mark.parametrize("mxfp4,dtype", [(False, "bfloat16"), (True, "float32")])
def test_variant_inventories(tmp_path, k3_config, mxfp4, dtype):
    logical = write_k3_checkpoint(tmp_path, k3_config, mxfp4=mxfp4, dtype=dtype, shards=2)
    stored = read_checkpoint(str(tmp_path))
    assert _inventory(stored) == expected_inventory(mxfp4=mxfp4, float32=dtype == "float32")
    on_disk = json.load(open(tmp_path / "config.json"))
    assert on_disk["dtype"] == on_disk["text_config"]["dtype"] == dtype
    assert ("quantization_config" in on_disk["text_config"]) == mxfp4
    assert set(logical) == {k.replace(".weight_packed", ".weight") for k in stored if not k.endswith(".weight_scale")}


def test_written_config_json(k3_checkpoint):
    on_disk = json.load(open(os.path.join(k3_checkpoint.folder, "config.json")))
    assert on_disk == k3_checkpoint.config  # bf16 + mxfp4: identical to the dict passed in


def test_index_covers_every_tensor_once(k3_checkpoint):
    folder = k3_checkpoint.folder
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    shard_names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) == shard_names
    seen: dict[str, str] = {}
    data_bytes = 0
    for file_name in shard_names:
        path = os.path.join(folder, file_name)
        with open(path, "rb") as f:  # safetensors: u64 header length, JSON header, then the data section
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        assert header.pop("__metadata__") == {"format": "pt"}
        assert header, f"{file_name} is empty"
        data_bytes += os.path.getsize(path) - 8 - header_len
        for name in header:
            assert name not in seen
            seen[name] = file_name
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == data_bytes
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in read_checkpoint(folder).values()
    )


def test_a_log_is_padded_with_zeros(k3_checkpoint):
    stored = read_checkpoint(k3_checkpoint.folder)
    for layer in KDA_LAYERS_0B:
        a_log = stored[f"{LM}layers.{layer}.self_attn.A_log"]
        assert a_log.dtype == torch.float32 and a_log.shape == (32,)
        assert torch.all(a_log[2:] == 0) and torch.all(a_log[:2] != 0)
        assert torch.equal(k3_checkpoint.tensors[f"{LM}layers.{layer}.self_attn.A_log"], a_log)


def test_logical_tensors_equal_the_stored_ones(k3_checkpoint):
    stored = read_checkpoint(k3_checkpoint.folder)
    logical = k3_checkpoint.tensors
    for name, value in logical.items():
        assert value.dtype == torch.float32
        if name in stored:
            assert torch.equal(stored[name].float(), value), name
            continue
        base = name.removesuffix(".weight")
        packed, scale = stored[f"{base}.weight_packed"].numpy(), stored[f"{base}.weight_scale"].numpy()
        assert np.array_equal(numpy_mxfp4_decode(packed, scale), value.double().numpy()), name


def test_expert_values_have_release_like_codes_and_scales(k3_checkpoint):
    stored = read_checkpoint(k3_checkpoint.folder)
    scales = torch.cat([v.flatten() for k, v in stored.items() if k.endswith(".weight_scale")])
    assert set(scales.unique().tolist()) == {123, 124, 125}  # 2^-4 .. 2^-2
    codes = torch.cat([unpack_mxfp4_codes(v).flatten() for k, v in stored.items() if k.endswith(".weight_packed")])
    assert set(codes.unique().tolist()) == set(range(16))


def test_writer_is_deterministic_and_mxfp4_matches_plain(tmp_path, k3_checkpoint):
    again = write_k3_checkpoint(tmp_path / "a", k3_checkpoint.config, seed=0)
    plain = write_k3_checkpoint(tmp_path / "b", k3_checkpoint.config, seed=0, mxfp4=False)
    other = write_k3_checkpoint(tmp_path / "c", k3_checkpoint.config, seed=1)
    for name, value in k3_checkpoint.tensors.items():
        assert torch.equal(again[name], value) and torch.equal(plain[name], value), name
    assert not torch.equal(other[f"{LM}embed_tokens.weight"], k3_checkpoint.tensors[f"{LM}embed_tokens.weight"])
    # bf16 tensors are exact in bf16; the F32 ones (e.g. dt_bias) really carry fp32 precision
    embed = k3_checkpoint.tensors[f"{LM}embed_tokens.weight"]
    assert torch.equal(embed.bfloat16().float(), embed)
    dt_bias = k3_checkpoint.tensors[f"{LM}layers.1.self_attn.dt_bias"]
    assert not torch.equal(dt_bias.bfloat16().float(), dt_bias)


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 packer
# ---------------------------------------------------------------------------------------------------------------


def test_e2m1_lut():
    values = e2m1_decode(torch.arange(16))
    assert values.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert math.copysign(1.0, values[8].item()) == -1.0  # code 8 is -0


def test_mxfp4_hand_written_bytes():
    # 0x2F: low nibble 0xF = -6 (element 0), high nibble 0x2 = +1 (element 1);
    # 0x9A: low 0xA = -1 (element 2), high 0x9 = -0.5 (element 3)
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[:, 0], packed[:, 1] = 0x2F, 0x9A
    scale = torch.tensor([[127], [128]], dtype=torch.uint8)  # x1, x2
    values = dequantize_mxfp4(packed, scale)
    assert values.shape == (2, 32)
    assert values[0, :4].tolist() == [-6.0, 1.0, -1.0, -0.5] and torch.all(values[0, 4:] == 0)
    assert values[1, :4].tolist() == [-12.0, 2.0, -2.0, -1.0]

    codes = torch.zeros(1, 32, dtype=torch.uint8)
    codes[0, :4] = torch.tensor([15, 2, 10, 9])
    p, s = pack_mxfp4(codes, torch.tensor([[126]], dtype=torch.uint8))
    assert p.dtype == torch.uint8 and p.shape == (1, 16) and p[0, :2].tolist() == [0x2F, 0x9A]
    assert torch.all(p[0, 2:] == 0) and s.tolist() == [[126]]
    assert mxfp4_from_codes(codes, s)[0, :4].tolist() == [-3.0, 0.5, -0.5, -0.25]


def test_mxfp4_groups_run_along_the_input_dim():
    codes = torch.full((1, 64), 2, dtype=torch.uint8)  # all +1
    values = mxfp4_from_codes(codes, torch.tensor([[127, 129]], dtype=torch.uint8))
    assert torch.all(values[0, :32] == 1) and torch.all(values[0, 32:] == 4)


def test_mxfp4_pack_roundtrip():
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (5, 96), generator=gen).to(torch.uint8)
    exponents = torch.randint(100, 140, (5, 3), generator=gen).to(torch.uint8)
    packed, scale = pack_mxfp4(codes, exponents)
    assert torch.equal(unpack_mxfp4_codes(packed), codes)
    assert np.array_equal(
        numpy_mxfp4_decode(packed.numpy(), scale.numpy()), mxfp4_from_codes(codes, exponents).double().numpy()
    )


# ---------------------------------------------------------------------------------------------------------------
# Reference components on hand-checkable inputs
# ---------------------------------------------------------------------------------------------------------------

D64 = torch.float64


def test_safe_gate_and_softplus_gate_at_a_point():
    f = torch.tensor([[[0.3]]], dtype=D64)
    a_log, dt_bias = torch.tensor([math.log(2.0)], dtype=D64), torch.tensor([[-1.3]], dtype=D64)
    # -5 * sigmoid(2 * (0.3 - 1.3)) = -5 * sigmoid(-2)
    assert ref.kda_safe_gate(f, a_log, dt_bias, -5.0).item() == pytest.approx(-0.5960146101105878, abs=1e-14)
    # -2 * softplus(-1)
    assert ref.kda_softplus_gate(f, a_log, dt_bias).item() == pytest.approx(-0.6265233750364457, abs=1e-14)


def test_situ_at_a_point():
    a, up = torch.tensor([2.0], dtype=D64), torch.tensor([10.0], dtype=D64)
    assert ref.situ(a, 4.0).item() == pytest.approx(1.6281257671922484, abs=1e-14)  # 4 tanh(1/2) sigmoid(2)
    assert ref.situ_glu(a, up, 4.0, 25.0).item() == pytest.approx(15.465117391642167, abs=1e-13)  # * 25 tanh(0.4)
    assert ref.situ_glu(a, up, 4.0, None).item() == pytest.approx(16.281257671922484, abs=1e-13)
    for beta in (0.0, None):  # `beta or 1.0`
        assert ref.situ(a, beta).item() == pytest.approx(0.8491126756208685, abs=1e-14)


def test_small_functions_match_torch():
    x = torch.randn(5, 7, dtype=D64)
    w = torch.randn(7, dtype=D64)
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-5), F.rms_norm(x, (7,), w, 1e-5))
    torch.testing.assert_close(ref.gelu_exact(x), F.gelu(x))
    torch.testing.assert_close(ref.gelu_tanh(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(ref.softplus(x * 30), F.softplus(x * 30))
    torch.testing.assert_close(ref.softmax(x), torch.softmax(x, -1))
    torch.testing.assert_close(ref.l2_normalize(x, 0.0), F.normalize(x, dim=-1))


def test_causal_short_conv_by_hand():
    x = torch.tensor([[1.0], [2.0], [3.0]], dtype=D64)
    w = torch.tensor([[[1.0, 10.0, 100.0, 1000.0]]], dtype=D64)  # w[..., 3] multiplies the current token
    assert ref.causal_short_conv(x, w)[:, 0].tolist() == [1000.0, 2100.0, 3210.0]
    # matches a left-padded depthwise conv1d
    x, w = torch.randn(6, 5, dtype=D64), torch.randn(5, 1, 4, dtype=D64)
    torch_conv = F.conv1d(F.pad(x.T[None], (3, 0)), w, groups=5)[0].T
    torch.testing.assert_close(ref.causal_short_conv(x, w), torch_conv)


def test_delta_rule_by_hand():
    one = torch.ones(1, 1, 1, dtype=D64)
    # K = V = 1: s1 = b1 k1 v1 = 0.5*1*2 = 1; s' = 0.5 s1; u = 1*(3 - 0.5) = 2.5; s2 = 0.5 + 2.5 = 3; o2 = s2 q2
    q = torch.cat([one, 2 * one])
    k = torch.cat([one, one])
    v = torch.cat([2 * one, 3 * one])
    g = torch.cat([0 * one, math.log(0.5) * one])
    beta = torch.tensor([[0.5], [1.0]], dtype=D64)
    o, state = ref.gated_delta_rule(q, k, v, g, beta)
    assert o[:, 0, 0].tolist() == [1.0, 6.0] and state.item() == 3.0


def test_delta_rule_beta_zero_keeps_state_zero_and_beta_one_stores_v():
    T, H, K, V = 5, 2, 4, 3
    q, k = (
        ref.l2_normalize(torch.randn(T, H, K, dtype=D64), 0.0),
        ref.l2_normalize(torch.randn(T, H, K, dtype=D64), 0.0),
    )
    v, g = torch.randn(T, H, V, dtype=D64), -torch.rand(T, H, K, dtype=D64)
    o, state = ref.gated_delta_rule(q, k, v, g, torch.zeros(T, H, dtype=D64))
    assert torch.all(o == 0) and torch.all(state == 0)
    # beta = 1, unit key: after the update S^T k == v exactly (the delta rule overwrites the value at k)
    _, state = ref.gated_delta_rule(q, k, v, g, torch.ones(T, H, dtype=D64))
    for h in range(H):
        torch.testing.assert_close(state[h].T @ k[-1, h], v[-1, h])


def test_mla_is_nope_permutation_invariant(k3_checkpoint):
    """No rotary embedding: the last token's output does not depend on the order of the earlier tokens."""
    tc = k3_checkpoint.config["text_config"]
    w = ref._Weights(k3_checkpoint.tensors)
    x = torch.randn(6, 96, dtype=D64)
    perm = torch.tensor([3, 0, 4, 1, 2, 5])
    out = ref.mla_attention(tc, w, f"{LM}layers.3.self_attn.", x)
    out_perm = ref.mla_attention(tc, w, f"{LM}layers.3.self_attn.", x[perm])
    torch.testing.assert_close(out_perm[-1], out[-1])
    assert not torch.allclose(out_perm[2], out[2])


def test_norm_eps_per_norm(k3_checkpoint):
    """MLA's q_a/kv_a layernorms use the fixed 1e-6 (not rms_norm_eps); KDA's o_norm uses rms_norm_eps (§3.3, §3.2)."""
    tc = k3_checkpoint.config["text_config"]
    big_eps = {**tc, "rms_norm_eps": 1e-1}
    tensors = dict(k3_checkpoint.tensors)
    mla, kda = f"{LM}layers.3.self_attn.", f"{LM}layers.1.self_attn."
    for name in (mla + "q_a_proj.weight", mla + "kv_a_proj_with_mqa.weight"):  # latents with mean square ~1e-6
        tensors[name] = tensors[name] * 1e-3
    w = ref._Weights(tensors)
    x = torch.randn(4, 96, dtype=D64)
    assert torch.equal(ref.mla_attention(tc, w, mla, x), ref.mla_attention(big_eps, w, mla, x))
    assert ref.MLA_LATENT_NORM_EPS == 1e-6
    q_a = ref.linear(x, w[mla + "q_a_proj.weight"])
    assert not torch.allclose(
        ref.rms_norm(q_a, None, 1e-6), ref.rms_norm(q_a, None, 1e-5), rtol=1e-3
    )  # eps matters here
    assert not torch.allclose(ref.kda_attention(tc, w, kda, x), ref.kda_attention(big_eps, w, kda, x))


def test_attn_res_mix_by_hand():
    blocks = [torch.tensor([[3.0, 4.0]], dtype=D64)]
    partial = torch.tensor([[1.0, -1.0]], dtype=D64)
    norm_w, proj_w = torch.tensor([1.0, 2.0], dtype=D64), torch.tensor([[1.0, 0.5]], dtype=D64)  # fold = [1, 1]
    # score(block) = (3 + 4) / sqrt(12.5); score(partial) = 0; alpha = sigmoid(score(block))
    out = ref.attn_res_mix(partial, blocks, norm_w, proj_w, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[2.7573407873731854, 3.3933519684329623]], dtype=D64))
    # one source: the mix is that source exactly
    assert torch.equal(ref.attn_res_mix(partial, [], norm_w, proj_w, 1e-5), partial)


def test_attn_res_state_machine_by_hand():
    """Zero projections make every mix a plain mean of its sources; 3 layers, block size 2, scalar stream.

    l0: h=1, push 1, P=a=10, h2=mean(1,10)=5.5, P=10+6.5=16.5
    l1: h=mean(1,16.5), P=16.5+87.5=104, h2=mean(1,104)=52.5, P=104+53.5=157.5
    l2: h=mean(1,157.5)=79.25, push the PRE-mix 157.5, P=a=792.5, h2=mean(1,157.5,792.5)=317, P=792.5+318=1110.5
    out = mean(1, 157.5, 1110.5) = 423
    """
    zero_fold = (torch.ones(1, dtype=D64), torch.zeros(1, 1, dtype=D64))
    layers = [(lambda h: 10 * h, lambda h: h + 1, zero_fold, zero_fold)] * 3
    out = ref.block_attn_res_stack(torch.ones(1, 1, dtype=D64), layers, zero_fold, block_size=2, eps=1e-5)
    assert out.item() == pytest.approx(423.0, rel=1e-14)  # softmax weights 1/3 are not exact in binary


def test_router_selects_on_corrected_scores_and_weights_from_plain_scores():
    tc = tiny_k3_config(num_experts_per_token=2)["text_config"]
    gate_w = torch.zeros(4, 3, dtype=D64)
    x = torch.zeros(1, 3, dtype=D64)
    gate_w[:, 0] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    x[0, 0] = 1.0  # scores sigmoid([2, 1, 0, -1])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=D64)  # promotes expert 3 over experts 1 and 2
    ids, weights = ref.moe_route(tc, x, gate_w, bias)
    assert sorted(ids[0].tolist()) == [0, 3]
    s = torch.sigmoid(torch.tensor([2.0, -1.0], dtype=D64))
    torch.testing.assert_close(weights[0][ids[0].argsort()], s / s.sum())


# ---------------------------------------------------------------------------------------------------------------
# The written random values make every component matter
# ---------------------------------------------------------------------------------------------------------------


def _hidden_like(n: int) -> torch.Tensor:
    return ref.rms_norm(torch.randn(n, 96, dtype=D64), None, 1e-5)


def test_decays_are_neither_zero_nor_one(k3_checkpoint):
    w = ref._Weights(k3_checkpoint.tensors)
    for layer in KDA_LAYERS_0B:
        p = f"{LM}layers.{layer}.self_attn."
        x = _hidden_like(64)
        f = ref.linear(ref.linear(x, w[p + "f_a_proj.weight"]), w[p + "f_b_proj.weight"]).view(64, 2, 32)
        decay = torch.exp(ref.kda_safe_gate(f, w[p + "A_log"][:2], w[p + "dt_bias"].view(2, 32), -5.0))
        q = decay.flatten().quantile(torch.tensor([0.05, 0.5, 0.95], dtype=D64))
        assert 0.05 < q[0] and 0.2 < q[1] < 0.9 and q[2] < 0.99, (layer, q)


def test_correction_bias_changes_some_selections(k3_checkpoint):
    tc = k3_checkpoint.config["text_config"]
    w = ref._Weights(k3_checkpoint.tensors)
    for layer in range(1, 7):
        p = f"{LM}layers.{layer}.block_sparse_moe.gate."
        x = _hidden_like(128)
        with_bias, _ = ref.moe_route(tc, x, w[p + "weight"], w[p + "e_score_correction_bias"])
        without, _ = ref.moe_route(tc, x, w[p + "weight"], None)
        changed = (with_bias.sort(-1).values != without.sort(-1).values).any(-1).double().mean()
        assert 0.05 < changed < 0.95, (layer, changed)


# (name, how to perturb); every one of these must move the logits
_PERTURBED = [
    (f"{LM}layers.1.self_attn.A_log", "heads"),
    (f"{LM}layers.1.self_attn.dt_bias", "noise"),
    (f"{LM}layers.1.self_attn.q_conv1d.weight", "noise"),
    (f"{LM}layers.1.self_attn.f_b_proj.weight", "noise"),
    (f"{LM}layers.1.self_attn.b_proj.weight", "noise"),
    (f"{LM}layers.1.self_attn.g_proj.weight", "noise"),
    (f"{LM}layers.1.self_attn.o_norm.weight", "noise"),
    (f"{LM}layers.3.self_attn.q_a_layernorm.weight", "noise"),
    (f"{LM}layers.3.self_attn.kv_a_layernorm.weight", "noise"),
    (f"{LM}layers.3.self_attn.kv_a_proj_with_mqa.weight", "rope_rows"),
    (f"{LM}layers.3.self_attn.g_proj.weight", "noise"),
    (f"{LM}layers.0.mlp.up_proj.weight", "noise"),
    (f"{LM}layers.2.block_sparse_moe.gate.e_score_correction_bias", "negate"),
    (f"{LM}layers.2.block_sparse_moe.routed_expert_norm.weight", "noise"),
    (f"{LM}layers.2.block_sparse_moe.shared_experts.down_proj.weight", "noise"),
    (f"{LM}layers.0.mlp_res_proj.weight", "noise"),
    (f"{LM}layers.1.self_attention_res_proj.weight", "noise"),
    (f"{LM}layers.4.mlp_res_norm.weight", "noise"),
    (f"{LM}output_attn_res_proj.weight", "noise"),
    (f"{LM}norm.weight", "noise"),
]


def _perturb(value: torch.Tensor, how: str) -> torch.Tensor:
    value = value.clone()
    if how == "heads":
        value[:2] += 0.5
    elif how == "negate":
        value = -value
    elif how == "rope_rows":  # k_rope rows of kv_a_proj_with_mqa: [latent 32 | k_rope 8]
        value[32:] += 0.5 * value.abs().mean() * torch.randn_like(value[32:])
    else:
        value += 0.5 * value.abs().mean() * torch.randn_like(value)
    return value


@pytest.fixture(scope="module")
def base_logits(k3_checkpoint):
    ids = torch.tensor([[256, 5, 17, 99, 3, 250, 42, 7, 128, 64]])
    return ids, ref.k3_reference_logits(k3_checkpoint.config, k3_checkpoint.tensors, ids)


def test_reference_logits_are_sane(base_logits, k3_config):
    _, logits = base_logits
    assert logits.dtype == D64 and logits.shape == (1, 10, 320)
    assert torch.isfinite(logits).all() and 0.3 < logits.std() < 10


@pytest.mark.parametrize("name,how", _PERTURBED, ids=[n.removeprefix(LM) for n, _ in _PERTURBED])
def test_every_component_moves_the_logits(k3_checkpoint, base_logits, name, how):
    ids, logits = base_logits
    tensors = {**k3_checkpoint.tensors, name: _perturb(k3_checkpoint.tensors[name], how)}
    moved = (ref.k3_reference_logits(k3_checkpoint.config, tensors, ids) - logits).abs().max()
    assert moved > 1e-3, moved


@pytest.mark.parametrize(
    "name,how",
    [
        (f"{LM}layers.0.self_attention_res_proj.weight", "noise"),
        (f"{LM}layers.0.self_attention_res_norm.weight", "noise"),
        (f"{LM}layers.1.self_attn.A_log", "padding"),
    ],
)
def test_dead_weights_do_not_move_the_logits(k3_checkpoint, base_logits, name, how):
    """Layer 0's attention-side fold sees an empty B (§3.6); A_log beyond num_heads is padding (§3.2)."""
    ids, logits = base_logits
    value = k3_checkpoint.tensors[name].clone()
    if how == "padding":
        value[2:] = 1.0
    else:
        value = _perturb(value, how)
    tensors = {**k3_checkpoint.tensors, name: value}
    assert torch.equal(ref.k3_reference_logits(k3_checkpoint.config, tensors, ids), logits)


def test_causality(k3_checkpoint, base_logits):
    ids, logits = base_logits
    changed = ids.clone()
    changed[0, 6:] = torch.tensor([1, 2, 3, 4])
    other = ref.k3_reference_logits(k3_checkpoint.config, k3_checkpoint.tensors, changed)
    assert torch.equal(other[:, :6], logits[:, :6])
    assert (other[:, 6:] - logits[:, 6:]).abs().amax(-1).min() > 1e-3


def test_batch_rows_are_independent(k3_checkpoint, base_logits):
    ids, logits = base_logits
    batch = torch.cat([ids, ids.flip(1)])
    out = ref.k3_reference_logits(k3_checkpoint.config, k3_checkpoint.tensors, batch)
    torch.testing.assert_close(out[:1], logits, rtol=0, atol=1e-12)


def test_latent_norm_cancels_routed_scaling(tmp_path):
    """K3 fact: with latent_moe_use_norm the norm of the weighted sum cancels routed_scaling_factor (up to eps)."""
    ids = torch.tensor([[256, 9, 31, 77, 200, 5]])
    for use_norm, tiny_change in ((True, True), (False, False)):
        config = tiny_k3_config(num_hidden_layers=3, latent_moe_use_norm=use_norm)
        tensors = write_k3_checkpoint(tmp_path / str(use_norm), config, seed=2)
        assert (f"{LM}layers.1.block_sparse_moe.routed_expert_norm.weight" in tensors) == use_norm
        scaled = tiny_k3_config(num_hidden_layers=3, latent_moe_use_norm=use_norm, routed_scaling_factor=2.5)
        a = ref.k3_reference_logits(config, tensors, ids)
        b = ref.k3_reference_logits(scaled, tensors, ids)
        assert ((a - b).abs().max() < 1e-4) == tiny_change


@pytest.mark.parametrize(
    "overrides",
    [
        dict(linear_attn_config={"gate_lower_bound": None}),
        dict(linear_attn_config={"use_full_rank_gate": False}),
        dict(q_lora_rank=None),
        dict(mla_use_output_gate=False),
        dict(attn_res_block_size=None),
        dict(routed_expert_hidden_size=None),
        dict(num_shared_experts=0),
    ],
    ids=["softplus_gate", "low_rank_output_gate", "no_q_lora", "no_mla_gate", "no_attn_res", "no_latent", "no_shared"],
)
def test_config_variants_write_and_run(tmp_path, overrides):
    base = tiny_k3_config(num_hidden_layers=4)
    config = tiny_k3_config(num_hidden_layers=4, **overrides)
    ids = torch.tensor([[256, 3, 14, 15, 92, 65]])
    tensors = write_k3_checkpoint(tmp_path, config, seed=4)
    logits = ref.k3_reference_logits(config, tensors, ids)
    assert torch.isfinite(logits).all()
    base_tensors = write_k3_checkpoint(tmp_path / "base", base, seed=4)
    assert set(tensors) != set(base_tensors) or "gate_lower_bound" in str(overrides)
    if "gate_lower_bound" in str(overrides):  # same tensors, different gate formula
        assert not torch.allclose(logits, ref.k3_reference_logits(base, base_tensors, ids))


def test_greedy_matches_repeated_argmax(k3_checkpoint, base_logits):
    ids, logits = base_logits
    out = ref.k3_reference_greedy(k3_checkpoint.config, k3_checkpoint.tensors, ids[:, :6], max_new_tokens=3)
    assert out.shape == (1, 9) and out.dtype == torch.int64
    assert torch.equal(out[:, :6], ids[:, :6])
    first = ref.k3_reference_logits(k3_checkpoint.config, k3_checkpoint.tensors, ids[:, :6])[0, -1].argmax()
    assert out[0, 6] == first
    full = ref.k3_reference_logits(k3_checkpoint.config, k3_checkpoint.tensors, out[:, :8])
    assert out[0, 8] == full[0, -1].argmax()


# ---------------------------------------------------------------------------------------------------------------
# Vision
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(8, 8), (4, 6), (6, 10), (12, 3)])
def test_bilinear_resize_matches_interpolate(size):
    grid = torch.randn(8, 8, 5, dtype=D64)
    torch_resized = F.interpolate(grid.permute(2, 0, 1)[None], size=size, mode="bilinear", align_corners=False)
    torch.testing.assert_close(ref.bilinear_resize(grid, *size), torch_resized[0].permute(1, 2, 0))


def test_rope_2d_by_hand():
    # head_dim 8: freqs [1, 10000^-0.5 = 0.01]; slots [x0, y0, x1, y1] with x = column
    angles = ref.rope_2d_angles(row=2, col=3, head_dim=8)
    torch.testing.assert_close(angles, torch.tensor([3.0, 2.0, 0.03, 0.02], dtype=D64))
    x = torch.randn(8, dtype=D64)
    rotated = torch.view_as_real(torch.view_as_complex(x.view(4, 2)) * torch.polar(torch.ones(4, dtype=D64), angles))
    torch.testing.assert_close(ref.apply_rope_interleaved(x, angles), rotated.flatten())
    assert torch.equal(ref.apply_rope_interleaved(x, ref.rope_2d_angles(0, 0, 8)), x)


def test_sd2_tpool_merge_by_hand():
    x = torch.arange(8, dtype=D64)[:, None]  # h=2, w=4, raster order
    merged = ref.sd2_tpool_merge(x, 1, 2, 4)
    assert merged.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


GRIDS = torch.tensor([[1, 8, 8], [1, 4, 6]])  # the first at the native pos-emb size, the second resized


@pytest.fixture(scope="module")
def images(k3_checkpoint):
    pixels = torch.randn(64 + 24, 3, 14, 14, generator=torch.Generator().manual_seed(5))
    return pixels, ref.k3_reference_image_features(k3_checkpoint.config, k3_checkpoint.tensors, pixels, GRIDS)


def test_image_features_shape_and_independence(k3_checkpoint, images):
    pixels, features = images
    assert features.shape == (16 + 6, 96) and features.dtype == D64 and torch.isfinite(features).all()
    norm_w = k3_checkpoint.tensors["mm_projector.post_norm.weight"].double()
    rms = (features / norm_w).pow(2).mean(-1).sqrt()  # post_norm: unit RMS before the weight
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=0)  # up to eps 1e-5
    other = pixels.clone()
    other[64:] = torch.randn(24, 3, 14, 14)
    again = ref.k3_reference_image_features(k3_checkpoint.config, k3_checkpoint.tensors, other, GRIDS)
    assert torch.equal(again[:16], features[:16]) and not torch.allclose(again[16:], features[16:])


def test_multimodal_logits_use_the_features_in_order(k3_checkpoint, images):
    pixels, features = images
    media = k3_checkpoint.config["media_placeholder_token_id"]
    ids = torch.tensor([[256, 11] + [media] * 16 + [12, 13] + [media] * 6 + [14]])
    cfg, tensors = k3_checkpoint.config, k3_checkpoint.tensors
    logits = ref.k3_reference_logits(cfg, tensors, ids, pixels, GRIDS)
    # the features replace the placeholder embeddings: text-only logits differ from the first placeholder on
    text_only = ref.k3_reference_logits(cfg, tensors, ids)
    assert torch.equal(logits[:, :2], text_only[:, :2]) and not torch.allclose(logits[:, 2:], text_only[:, 2:])
    # changing image 2 changes nothing before its first placeholder (position 20)
    other = pixels.clone()
    other[64:] = torch.randn(24, 3, 14, 14)
    moved = ref.k3_reference_logits(cfg, tensors, ids, other, GRIDS)
    assert torch.equal(moved[:, :20], logits[:, :20]) and (moved[:, 20:] - logits[:, 20:]).abs().max() > 1e-3
    with pytest.raises(ValueError):
        ref.k3_reference_logits(cfg, tensors, ids[:, :-3], pixels, GRIDS)
