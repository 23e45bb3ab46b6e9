"""torch.compile(fullgraph=True): generate's compiled decoding steps (a static cache; `_can_compile_fullgraph`)
give eager's tokens, for the text model and for the multimodal model after an image prefill. Compiled training
(fullgraph forward + backward = eager) is transformers' test_torch_compile_for_training in test_common_suite.py."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import CompileConfig

from kimi_hf import KimiHybridForCausalLM, KimiHybridForConditionalGeneration

from .helpers import tiny_config, tiny_multimodal_config, tiny_processor


def compile_on_cpu() -> CompileConfig:
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True  # generate compiles on accelerators only unless told (transformers' test flag)
    return config


@pytest.mark.parametrize("multimodal", [False, True])
def test_compiled_decoding_gives_the_eager_tokens(multimodal):
    torch.manual_seed(0)
    if multimodal:
        model = KimiHybridForConditionalGeneration(tiny_multimodal_config()).eval()
        proc = tiny_processor()
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
        content = [{"type": "image"}, {"type": "text", "text": "how many circles?"}]
        text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = dict(proc(images=[image], text=text))
    else:
        model = KimiHybridForCausalLM(tiny_config()).eval()
        x = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(1))
        inputs = dict(input_ids=x, attention_mask=torch.ones_like(x))
    kwargs = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, cache_implementation="static")
    eager = model.generate(**inputs, **kwargs)
    torch.compiler.reset()
    compiled = model.generate(**inputs, compile_config=compile_on_cpu(), **kwargs)
    assert getattr(model, "_compiled_call", None) is not None  # generate did take the compiled path
    assert torch.equal(compiled, eager)
