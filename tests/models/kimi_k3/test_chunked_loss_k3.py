"""The chunked language-model head + loss as a model option (`loss_chunk_size` of the text config, issue 38 section 4):
a tiny Kimi K3 and a Kimi Linear model with tied embeddings give the plain loss and the same gradient for every
parameter (fp32: measured max error 7e-7 of each parameter's largest gradient, allowed 1e-5), return `logits=None`;
forwards without labels or with logits_to_keep are unchanged; the field is validated by name, read back, and in K3's
config (released field names) written only when set; transformers' Trainer trains the same with it."""

import json

import pytest
import torch
from transformers import AutoConfig, Trainer

from kimi_hf import KimiHybridForCausalLM, KimiK3Config, KimiK3TextConfig
from kimi_hf.models.kimi_hybrid.configuration_kimi_hybrid import KimiHybridTextConfig
from kimi_hf.models.kimi_k3.modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3ForConditionalGeneration

from ...optim.trainer_helpers import args as training_args
from ...optim.trainer_helpers import dataset
from ..kimi_hybrid.helpers import tiny_config
from .release_format import tiny_k3_config


TOL = 1e-5  # of each parameter's largest gradient


def k3_model() -> KimiK3ForConditionalGeneration:
    torch.manual_seed(0)
    config = KimiK3Config(**tiny_k3_config())
    config.text_config.use_cache = False
    return KimiK3ForConditionalGeneration(config).float().train()


def batch(vocab: int, B=2, T=24, seed=1) -> torch.Tensor:
    return torch.randint(3, min(vocab, 97), (B, T), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, ids, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_training(model, ids, chunk: int, **kwargs):
    text = model.config.get_text_config()
    plain, plain_grads = loss_and_grads(model, ids, **kwargs)
    text.loss_chunk_size = chunk
    try:
        chunked, grads = loss_and_grads(model, ids, **kwargs)
    finally:
        text.loss_chunk_size = None
    assert plain.logits is not None and chunked.logits is None
    assert chunked.loss.item() == pytest.approx(plain.loss.item(), rel=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, g in plain_grads.items():
        err = ((grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        assert err <= TOL or g.abs().max() == grads[name].abs().max() == 0, (name, err)
    return plain, chunked


def test_k3_trains_the_same_with_the_chunked_loss():
    model = k3_model()
    ids = batch(model.config.text_config.vocab_size)
    assert_same_training(model, ids, chunk=5)
    assert_same_training(model, ids, chunk=5, num_items_in_batch=torch.tensor(40))  # Trainer's divisor


def test_k3_text_model_trains_the_same():
    torch.manual_seed(0)
    config = KimiK3TextConfig(**tiny_k3_config()["text_config"])
    model = KimiK3ForCausalLM(config).float().train()
    assert_same_training(model, batch(config.vocab_size), chunk=7)


def test_tied_embeddings_receive_the_head_gradient():
    """Kimi Linear ties lm_head to embed_tokens when asked (`_tied_weights_keys`): the chunked loss's head gradient
    lands on the one shared weight, as the plain loss's does."""
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(tiny_config(tie_word_embeddings=True)).float().train()
    assert model._tied_weights_keys == {"lm_head.weight": "model.embed_tokens.weight"}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = batch(model.config.vocab_size)
    assert_same_training(model, ids, chunk=4)
    model.config.loss_chunk_size = 4
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    embed = model.model.embed_tokens.weight.grad
    rows = torch.ones(embed.shape[0], dtype=torch.bool)
    rows[ids.unique()] = False  # rows of tokens never input: their gradient is the head's alone
    assert embed[rows].abs().sum() > 0


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]])
def test_peft_models_train_the_same(modules_to_save):
    """LoRA (the head a plain nn.Linear: the fused path) and LoRA with a trained copy of the head (PEFT's
    ModulesToSaveWrapper: the head's own module, chunk by chunk under checkpointing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = KimiHybridForCausalLM(tiny_config()).float()
    config = LoraConfig(r=4, target_modules=["q_proj", "o_proj"], modules_to_save=modules_to_save)
    model = get_peft_model(base, config).train()
    assert (type(base.lm_head).__name__ == "Linear") == (modules_to_save is None)
    assert_same_training(model, batch(base.config.vocab_size), chunk=6)


def test_forwards_without_labels_or_with_logits_to_keep_are_unchanged():
    model = k3_model().eval()
    ids = batch(model.config.text_config.vocab_size)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        model.config.text_config.loss_chunk_size = 8
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, plain)
        last = model(input_ids=ids, logits_to_keep=1, use_cache=False).logits
        assert last.shape[1] == 1
        torch.testing.assert_close(last, plain[:, -1:])  # (one row's matmul may round apart from many rows')
        assert model(input_ids=ids, labels=ids, use_cache=False).logits is None


def test_a_replaced_loss_function_is_refused():
    model = KimiHybridForCausalLM(tiny_config(loss_chunk_size=4))
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    ids = batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="loss_chunk_size"):
        model(input_ids=ids, labels=ids)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "4096"])
def test_the_field_is_validated_by_name(bad):
    with pytest.raises(ValueError, match="loss_chunk_size"):
        KimiHybridTextConfig(loss_chunk_size=bad)


def test_the_field_is_saved_only_when_set(tmp_path):
    # Kimi Linear's config writes every field of ours (null when unset), as transformers writes them
    config = KimiHybridTextConfig(loss_chunk_size=4096)
    config.save_pretrained(tmp_path / "hybrid")
    assert json.loads((tmp_path / "hybrid" / "config.json").read_text())["loss_chunk_size"] == 4096
    assert AutoConfig.from_pretrained(tmp_path / "hybrid").loss_chunk_size == 4096
    # K3's config: the released field names, ours only when set
    released = KimiK3Config(**tiny_k3_config())
    plain = released.to_dict()
    assert "loss_chunk_size" not in plain["text_config"] and "loss_chunk_size" not in plain
    released.text_config.loss_chunk_size = 2048
    written = released.to_dict()
    assert written["text_config"].pop("loss_chunk_size") == 2048
    assert written == plain  # nothing else moves, no extra-attributes note
    released.text_config.loss_chunk_size = 2048
    released.save_pretrained(tmp_path / "k3")
    back = AutoConfig.from_pretrained(tmp_path / "k3")
    assert back.text_config.loss_chunk_size == 2048 and back.to_dict() == released.to_dict()
    # the text config saved alone (KimiK3ForCausalLM's config.json)
    text = KimiK3TextConfig(**tiny_k3_config()["text_config"], loss_chunk_size=512)
    text.save_pretrained(tmp_path / "text")
    assert AutoConfig.from_pretrained(tmp_path / "text").loss_chunk_size == 512


def test_transformers_trainer_trains_the_same(tmp_path):
    """Trainer calls model(**batch) with labels (and num_items_in_batch): the option needs nothing from it."""
    losses, weights = {}, {}
    for chunk in (None, 16):
        torch.manual_seed(0)
        model = KimiHybridForCausalLM(tiny_config(loss_chunk_size=chunk)).float()
        args = training_args(tmp_path / str(chunk), max_steps=2, logging_steps=1, optim="sgd", learning_rate=0.1)
        trainer = Trainer(model=model, args=args, train_dataset=dataset(n=8))
        trainer.train()
        losses[chunk] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        weights[chunk] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert losses[16] == pytest.approx(losses[None], rel=1e-5) and len(losses[16]) == 2
    for name, w in weights[None].items():
        torch.testing.assert_close(weights[16][name], w, rtol=1e-5, atol=1e-6, msg=name)
