"""PEFT LoRA on the hybrid model: train, save the adapter, reload it, merge it."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from kimi_hf import LORA_TARGET_MODULES, KimiHybridForCausalLM

from .helpers import rel_err, tiny_config, train_losses


def train_steps(model, x, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return train_losses(model, opt, [x] * steps)


@pytest.mark.parametrize("targets", ["all-linear", LORA_TARGET_MODULES])
def test_lora_train_save_reload_merge(tmp_path, targets):
    torch.manual_seed(0)
    base = KimiHybridForCausalLM(tiny_config())
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # both the KDA and the MLA projections are adapted
    assert any("layers.0.self_attn.q_proj.lora_A" in n for n in trainable)
    assert any("layers.3.self_attn.kv_b_proj.lora_A" in n for n in trainable)
    x = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = train_steps(peft_model.train(), x)
    assert losses[-1] < losses[0]

    peft_model.eval()
    with torch.no_grad():
        tuned = peft_model(input_ids=x).logits
    peft_model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists()

    torch.manual_seed(0)
    fresh = KimiHybridForCausalLM(tiny_config())  # same seed: the same base weights
    reloaded = PeftModel.from_pretrained(fresh, tmp_path).eval()
    with torch.no_grad():
        assert rel_err(reloaded(input_ids=x).logits, tuned) < 1e-6
        merged = reloaded.merge_and_unload()
        assert isinstance(merged, KimiHybridForCausalLM)
        assert rel_err(merged(input_ids=x).logits, tuned) < 1e-5
