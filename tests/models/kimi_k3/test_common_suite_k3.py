"""transformers' own common model tests on the Kimi K3 classes (issue 24 item 12), as test_common_suite.py runs them on
the hybrid ones: ModelTesterMixin, ConfigTester, the tensor-parallel, expert-parallel and training mixins (from the
sdist of the installed transformers; skipped only if it cannot be downloaded) on

    KimiK3TextModel, KimiK3ForCausalLM                 (as transformers' CausalLMModelTest runs a causal LM)
    KimiK3Model, KimiK3ForConditionalGeneration        (as its VLMModelTest runs a VLM)

with a two-layer K3 (a safe-gate KDA layer with the full-rank output gate and a SiTU FFN, then a gated MLA layer with
q LoRA and a Stable LatentMoE block; Block Attention Residuals every layer) and a two-layer MoonViT3d tower with the
patchmergerv2 projector, built from the released config.json spelling (release_format.tiny_k3_config).
"""

import copy
import inspect
import unittest

import torch

from kimi_hf import (
    KimiHybridCache,
    KimiK3Config,
    KimiK3ForCausalLM,
    KimiK3ForConditionalGeneration,
    KimiK3Model,
    KimiK3TextConfig,
    KimiK3TextModel,
)

from ..kimi_hybrid.test_common_suite import (  # the shared machinery (not the hybrid test classes)
    LOAD_ONLY_CONVERSION,
    PLACEHOLDERS_NEED_PIXELS,
    ConfigTester,
    ExpertParallelTesterMixin,
    ModelTesterMixin,
    TensorParallelTesterMixin,
    TrainingTesterMixin,
    _Common,
    _our_auto_class_names,  # noqa: F401  (an autouse fixture: the Auto tables know our model types here too)
    check_attention_outputs,
    floats_tensor,
    ids_tensor,
    torch_device,
    xfail_tests,
)
from .release_format import tiny_k3_config


RELEASED = tiny_k3_config(
    boilerplate=False,
    num_hidden_layers=2,
    linear_attn_config={"kda_layers": [1], "full_attn_layers": [2]},
    attn_res_block_size=1,
    quantization_config=None,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=32,
    routed_expert_hidden_size=32,
    num_experts=4,
    num_experts_per_token=2,
    num_shared_experts=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    initializer_range=0.1,
)
RELEASED["text_config"]["linear_attn_config"]["head_dim"] = 8
# fp32 like the other suites' tiny configs (the release says bfloat16, which from_pretrained's dtype="auto" follows)
RELEASED["dtype"] = RELEASED["text_config"]["dtype"] = "float32"
LAYER_TYPES = ["linear_attention", "full_attention"]


# as transformers' testers, token ids at the start of the vocabulary (test_resize_tokens_embeddings shrinks it to 4)
SMALL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def text_config() -> KimiK3TextConfig:
    config = copy.deepcopy(KimiK3Config(**copy.deepcopy(RELEASED)).text_config)
    for key, value in SMALL_IDS.items():
        setattr(config, key, value)
    return config


# ConfigTester's fields: the released text_config's own (not the provenance keys of the release's nested copy)
TEXT_CONFIG_FIELDS = {
    **{
        k: v
        for k, v in RELEASED["text_config"].items()
        if k not in ("auto_map", "architectures", "model_type", "transformers_version")
    },
    **SMALL_IDS,
}


class KimiK3TextModelTester:
    """transformers' CausalLMModelTester contract for KimiK3ForCausalLM."""

    config_class = KimiK3TextConfig
    base_model_class = KimiK3TextModel
    causal_lm_class = KimiK3ForCausalLM
    sequence_classification_class = None
    token_classification_class = None
    question_answering_class = None

    def __init__(self, parent, batch_size=13, seq_length=7, is_training=True, use_input_mask=True):
        self.parent = parent
        self.batch_size, self.seq_length = batch_size, seq_length
        self.is_training, self.use_input_mask = is_training, use_input_mask
        config = text_config()
        for key in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
        ):
            setattr(self, key, getattr(config, key))
        self.type_sequence_label_size, self.num_labels, self.num_choices = 2, 3, 4

    @property
    def all_model_classes(self):
        return [self.base_model_class, self.causal_lm_class]

    def get_config(self):
        return text_config()

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = torch.tril(torch.ones_like(input_ids)).to(torch_device) if self.use_input_mask else None
        return self.get_config(), input_ids, mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": mask}


XFAIL_TEXT = {}


@xfail_tests(XFAIL_TEXT)
class KimiK3TextCommonTest(
    _Common,
    ModelTesterMixin,
    TensorParallelTesterMixin,
    ExpertParallelTesterMixin,
    TrainingTesterMixin,
    unittest.TestCase,
):
    model_tester_class = KimiK3TextModelTester
    all_model_classes = (KimiK3TextModel, KimiK3ForCausalLM)
    _torch_compile_train_cls = KimiK3ForCausalLM

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        self.config_tester = ConfigTester(self, config_class=KimiK3TextConfig, **TEXT_CONFIG_FIELDS)

    def _skip_if_tp_distributed_not_enabled(self):  # as the hybrid text model: the plans are there, run them
        pass

    def _skip_if_ep_distributed_not_enabled(self):
        pass

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_torch_compile_for_training(self):
        """Run on CPU, as for the hybrid text model (transformers marks it @slow and accelerator-only)."""
        inspect.unwrap(ModelTesterMixin.test_torch_compile_for_training)(self)

    @unittest.skip("transformers' GenerationTesterMixin is not in the sdist; K3 generate: test_modeling_k3.py")
    def test_generation_tester_mixin_inheritance(self):
        pass

    def test_attention_outputs(self):
        check_attention_outputs(self, LAYER_TYPES.count("full_attention"), self.model_tester.num_attention_heads)

    @unittest.skip(LOAD_ONLY_CONVERSION)
    def test_reverse_loading_mapping(self):
        pass

    def test_linear_attention_multi_token_cached_forward_matches_single_token(self):
        config = self.model_tester.get_config()
        model = KimiK3TextModel._from_config(config, attn_implementation="eager").to(torch_device).eval()
        prompt, token = ids_tensor((1, 8), config.vocab_size), ids_tensor((1, 1), config.vocab_size)
        with torch.no_grad():
            single = KimiHybridCache(config=config)
            model(input_ids=prompt, past_key_values=single, use_cache=True)
            ref = model(input_ids=token, past_key_values=single, use_cache=True).last_hidden_state[:, 0]
            multi = KimiHybridCache(config=config)
            model(input_ids=prompt, past_key_values=multi, use_cache=True)
            more = torch.cat([token, ids_tensor((1, 7), config.vocab_size)], 1)
            got = model(input_ids=more, past_key_values=multi, use_cache=True).last_hidden_state[:, 0]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


GRID = (1, 4, 4)  # one 4 x 4-patch image per row: 2 x 2 merged into 4 placeholder tokens


class KimiK3VLMTester:
    """transformers' VLMModelTester contract for KimiK3ForConditionalGeneration: flat MoonViT3d patches
    pixel_values [B * t h w, 3, p, p] and image_grid_thw [B, 3], the placeholders at the start of each row."""

    config_class = KimiK3Config
    base_model_class = KimiK3Model
    conditional_generation_class = KimiK3ForConditionalGeneration
    sequence_classification_class = None

    def __init__(self, parent, batch_size=3, seq_length=7, is_training=True):
        self.parent = parent
        config = self.get_config()
        self.batch_size, self.is_training = batch_size, is_training
        self.image_token_id = config.image_token_id
        t, h, w = GRID
        self.num_patches = t * h * w
        self.patch_size = config.vision_config.patch_size
        self.num_image_tokens = self.num_patches // 4
        self.seq_length = seq_length + self.num_image_tokens
        text = config.text_config
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "pad_token_id"):
            setattr(self, key, getattr(text, key))
        self.bos_token_id, self.eos_token_id = text.bos_token_id, text.eos_token_id

    @property
    def all_model_classes(self):
        return [self.base_model_class, self.conditional_generation_class]

    def get_config(self):
        return KimiK3Config(**copy.deepcopy(RELEASED))

    def prepare_config_and_inputs_for_common(self):
        config = self.get_config()
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_ids[input_ids == self.image_token_id] = self.pad_token_id
        input_ids[:, : self.num_image_tokens] = self.image_token_id
        pixel_values = floats_tensor([self.batch_size * self.num_patches, 3, self.patch_size, self.patch_size])
        inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.tril(torch.ones_like(input_ids)).to(torch_device),
            "pixel_values": pixel_values,
            "image_grid_thw": torch.tensor([GRID] * self.batch_size, device=torch_device),
        }
        return config, inputs


XFAIL_VLM = {
    "test_eager_matches_sdpa_inference_*": PLACEHOLDERS_NEED_PIXELS,
}


@xfail_tests(XFAIL_VLM)
class KimiK3MultimodalCommonTest(
    _Common, ModelTesterMixin, TensorParallelTesterMixin, ExpertParallelTesterMixin, unittest.TestCase
):
    model_tester_class = KimiK3VLMTester
    all_model_classes = (KimiK3Model, KimiK3ForConditionalGeneration)
    _is_composite = True

    def setUp(self):
        self.model_tester = self.model_tester_class(self)
        self.config_tester = ConfigTester(self, config_class=KimiK3Config, has_text_modality=False)

    def test_config(self):
        self.config_tester.run_common_tests()

    @unittest.skip("transformers' GenerationTesterMixin is not in the sdist; K3 generate: test_modeling_k3.py")
    def test_generation_tester_mixin_inheritance(self):
        pass

    def test_attention_outputs(self):
        check_attention_outputs(self, LAYER_TYPES.count("full_attention"), self.model_tester.num_attention_heads)

    @unittest.skip(LOAD_ONLY_CONVERSION)
    def test_reverse_loading_mapping(self):
        pass
