"""Kimi K3's configs read back what they write (issue 24 item 9): attributes set on an instance beyond the class's
fields (users and transformers' tests add some) survive save_pretrained / from_pretrained in the vision and the text
config, while a foreign config.json field of an architecture we do not run is still refused by name."""

import copy
import json

import pytest
from transformers import AutoConfig

from kimi_hf import KimiK3Config, KimiK3TextConfig, KimiK3VisionConfig

from .release_format import tiny_k3_config


def test_extra_attributes_survive_a_save_and_load(tmp_path):
    config = KimiK3Config(**tiny_k3_config())
    config.vision_config.layer_norm_epsilon = 1e-3  # what transformers' set_config_for_less_flaky_test does
    config.vision_config.my_note = "kept"
    config.text_config.norm_eps = 1e-4
    config.run_note = "top level too"
    config.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert back.vision_config.layer_norm_epsilon == 1e-3 and back.vision_config.my_note == "kept"
    assert back.text_config.norm_eps == 1e-4 and back.run_note == "top level too"
    assert back.to_dict() == config.to_dict()
    written = json.loads((tmp_path / "config.json").read_text())
    # the released fields first, the extras after them, named
    assert written["vision_config"]["kimi_hf_extra_attributes"] == ["layer_norm_epsilon", "my_note"]
    assert written["text_config"]["kimi_hf_extra_attributes"] == ["norm_eps"]
    assert written["kimi_hf_extra_attributes"] == ["run_note"]
    # a config without extras is written in the released spelling alone, and reads back to the same file
    plain = KimiK3Config(**tiny_k3_config())
    plain.save_pretrained(tmp_path / "plain")
    AutoConfig.from_pretrained(tmp_path / "plain").save_pretrained(tmp_path / "again")
    text = (tmp_path / "plain" / "config.json").read_text()
    assert "kimi_hf_extra_attributes" not in text and text == (tmp_path / "again" / "config.json").read_text()


def test_a_foreign_field_is_still_refused_by_name():
    released = tiny_k3_config()
    vision = copy.deepcopy(released["vision_config"])
    vision["use_deformable_patches"] = True
    with pytest.raises(ValueError, match="use_deformable_patches"):
        KimiK3VisionConfig(**vision)
    text = copy.deepcopy(released["text_config"])
    text["num_mtp_modules"] = 1
    with pytest.raises(ValueError, match="num_mtp_modules"):
        KimiK3TextConfig(**text)


def test_a_text_config_saved_alone_is_read_as_k3(tmp_path):
    """KimiK3ForCausalLM's config.json: model_type kimi_k3_text (the nested form says kimi_linear, which AutoConfig
    would read as transformers' own Kimi Linear), the released field names otherwise."""
    text = KimiK3Config(**tiny_k3_config()).text_config
    assert text.experts_quantization_config is not None  # the release's MXFP4 scheme, not written alone
    text.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "kimi_k3_text" and "linear_attn_config" in written
    assert "quantization_config" not in written  # a text model saved alone holds dense experts
    back = AutoConfig.from_pretrained(tmp_path)
    assert type(back) is KimiK3TextConfig
    assert back.to_dict() == {k: v for k, v in text.to_dict().items() if k != "quantization_config"}
