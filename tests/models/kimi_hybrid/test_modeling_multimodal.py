"""KimiHybridForConditionalGeneration: early fusion (features at the placeholders), text-only input,
clear errors, generate() (images encoded once; equals repeated full forwards; batched with left
padding), inputs_embeds with pixel_values (forward and generate), get_image_features (transformers'
VLM API), Auto classes and save/load, the image-text-to-text pipeline, PEFT LoRA, Trainer."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Trainer, TrainingArguments, pipeline
from transformers.modeling_outputs import BaseModelOutputWithPooling

from kimi_hf import KimiHybridForConditionalGeneration
from kimi_hf.collators import KimiHybridVisionCollator

from .helpers import tiny_multimodal_config, tiny_processor


def img(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = KimiHybridForConditionalGeneration(tiny_multimodal_config()).eval()
    return model, tiny_processor()


def prompt(proc, question="how many circles?", images=1):
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    return proc.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def test_forward_loss_and_gradients_reach_the_vision_tower(setup):
    model, proc = setup
    batch = proc(images=[img(56, 56)], text=prompt(proc))
    model.train()
    out = model(**batch, labels=batch["input_ids"])
    out.loss.backward()
    model.eval()
    assert torch.isfinite(out.loss)
    assert model.model.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.model.mm_projector.out_proj.weight.grad.abs().sum() > 0
    model.zero_grad()


def test_image_features_sit_at_the_placeholders(setup):
    model, proc = setup
    a = proc(images=[img(56, 56, seed=1)], text=prompt(proc))
    b = proc(images=[img(56, 56, seed=2)], text=prompt(proc))
    first = int((a["input_ids"][0] == proc.image_token_id).nonzero()[0])
    with torch.no_grad():
        la, lb = model(**a).logits, model(**b).logits
    assert torch.allclose(la[0, :first], lb[0, :first])  # causal: nothing before the image sees it
    assert not torch.allclose(la[0, first:], lb[0, first:])
    text_only = proc(text="just text")
    with torch.no_grad():
        assert torch.isfinite(model(**text_only).logits).all()


def test_mismatches_raise_clear_errors(setup):
    model, proc = setup
    batch = proc(images=[img(56, 56)], text=prompt(proc))
    with pytest.raises(ValueError, match="placeholder tokens but the images give"):
        ids = batch["input_ids"][0].tolist()
        ids.remove(proc.image_token_id)  # one placeholder short: never shift text against images silently
        model(
            input_ids=torch.tensor([ids]), pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]
        )
    with pytest.raises(ValueError, match="no pixel_values"):
        model(input_ids=batch["input_ids"])


def test_generate_encodes_images_once_and_matches_full_forwards(setup):
    model, proc = setup
    batch = proc(images=[img(56, 84)], text=prompt(proc))
    calls = []
    hook = model.model.vision_tower.register_forward_hook(lambda *a: calls.append(1))
    try:
        out = model.generate(**batch, max_new_tokens=6, do_sample=False)
    finally:
        hook.remove()
    assert len(calls) == 1
    seq = batch["input_ids"]
    with torch.no_grad():
        for _ in range(6):
            nxt = (
                model(input_ids=seq, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
                .logits[:, -1]
                .argmax(-1)
            )
            seq = torch.cat([seq, nxt[:, None]], 1)
    assert torch.equal(out, seq)


def test_batched_generation_with_left_padding_and_different_image_counts(setup):
    model, proc = setup
    assert proc.tokenizer.padding_side == "left"  # train_tokenizer's default, for generation
    texts = [prompt(proc, "two?", images=2), prompt(proc, "one?")]
    images = [img(56, 56, 3), img(28, 56, 4), img(56, 28, 5)]
    batch = proc(images=images, text=texts, padding=True)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)[:, batch["input_ids"].shape[1] :]
    singles = [
        model.generate(**proc(images=ims, text=t), max_new_tokens=4, do_sample=False)[0, -4:]
        for t, ims in zip(texts, [images[:2], images[2:]])
    ]
    assert torch.equal(out[0], singles[0]) and torch.equal(out[1], singles[1])


def test_auto_classes_save_load_and_pipeline(setup, tmp_path):
    model, proc = setup
    model.save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    batch = proc(images=[img(56, 56)], text=prompt(proc))
    with torch.no_grad():
        ref = model(**batch).logits
        for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
            loaded = auto.from_pretrained(tmp_path).eval()
            assert isinstance(loaded, KimiHybridForConditionalGeneration)
            assert torch.allclose(loaded(**batch).logits, ref, atol=1e-5)
    pipe = pipeline("image-text-to-text", model=model, processor=proc)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": img(56, 56)}, {"type": "text", "text": "count"}]}
    ]
    result = pipe(text=messages, max_new_tokens=3, do_sample=False)
    assert isinstance(result[0]["generated_text"], (str, list))


def test_lora_and_trainer_with_the_collator(tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = KimiHybridForConditionalGeneration(tiny_multimodal_config())
    proc = tiny_processor()
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert any("vision_tower" in n for n in trainable) and any("language_model" in n for n in trainable)
    examples = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]},
                {"role": "assistant", "content": str(i)},
            ],
            "images": [img(28, 28, i)],
        }
        for i in range(4)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=2,
        learning_rate=1e-2,
        report_to=[],
        remove_unused_columns=False,
        use_cpu=True,
        save_strategy="no",
    )
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    trainer = Trainer(model=lora, args=args, train_dataset=examples, data_collator=KimiHybridVisionCollator(proc))
    result = trainer.train()
    assert np.isfinite(result.training_loss)
    assert any(not torch.equal(p, before[n]) for n, p in lora.named_parameters() if p.requires_grad)


def two_prompt_batch(proc):
    """Two prompts, left-padded: two images (different sizes) in the first, one in the second."""
    texts = [prompt(proc, "two?", images=2), prompt(proc, "and this one?")]
    return proc(images=[img(56, 56, 6), img(28, 56, 7), img(56, 84, 8)], text=texts, padding=True)


def test_inputs_embeds_with_pixel_values_match_input_ids(setup):
    """The placeholders are found in inputs_embeds as the rows equal to the embedding of image_token_id (as
    transformers' VLMs do): KimiHybridModel's last_hidden_state and the logits equal the input_ids path's
    (max abs diff <= 1e-5, fp32), and the images matter (without pixel_values the logits differ)."""
    model, proc = setup
    batch = two_prompt_batch(proc)
    assert (batch["attention_mask"] == 0).any()  # the second prompt is padded
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "attention_mask")}
    embeds = model.get_input_embeddings()(batch["input_ids"])
    with torch.no_grad():
        for m, field in ((model.model, "last_hidden_state"), (model, "logits")):
            ref = getattr(m(input_ids=batch["input_ids"], **images), field)
            got = getattr(m(inputs_embeds=embeds, **images), field)
            assert got.shape == ref.shape and (got - ref).abs().max() <= 1e-5
        text_only = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).logits
        assert (text_only - got).abs().max() > 1e-3


def test_inputs_embeds_placeholder_mismatch_raises(setup):
    model, proc = setup
    batch = proc(images=[img(56, 56)], text=prompt(proc))
    ids = batch["input_ids"][0].tolist()
    ids.remove(proc.image_token_id)  # one placeholder short
    embeds = model.get_input_embeddings()(torch.tensor([ids]))
    with pytest.raises(
        ValueError, match="inputs_embeds hold 3 image placeholder tokens but the images give 4 features"
    ):
        model(inputs_embeds=embeds, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    with pytest.raises(ValueError, match="image_grid_thw"):
        model(inputs_embeds=embeds, pixel_values=batch["pixel_values"])


def test_generate_from_inputs_embeds_with_images_matches_input_ids(setup):
    """generate(inputs_embeds=..., pixel_values=...) returns the same greedy new tokens as generate(input_ids=...),
    batched with left padding; the images are still encoded once."""
    model, proc = setup
    batch = two_prompt_batch(proc)
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "attention_mask")}
    gen = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ref = model.generate(input_ids=batch["input_ids"], **images, **gen)[:, batch["input_ids"].shape[1] :]
        calls = []
        hook = model.model.vision_tower.register_forward_hook(lambda *a: calls.append(1))
        try:
            got = model.generate(inputs_embeds=model.get_input_embeddings()(batch["input_ids"]), **images, **gen)
        finally:
            hook.remove()
    assert len(calls) == 1
    assert ref.shape[1] > 0 and torch.equal(got, ref)


def test_get_image_features_follows_the_transformers_vlm_api(setup):
    """get_image_features returns the tower's BaseModelOutputWithPooling: last_hidden_state = the tower's output,
    pooler_output = a tuple of per-image projected features (as transformers' kimi_k25), whose concatenation is
    exactly what the forward writes into the placeholder positions; hidden_states (num_layers + 1) and
    attentions ([1, heads, N, N] per layer) when asked; a tuple with return_dict=False."""
    model, proc = setup
    batch = two_prompt_batch(proc)
    pv, grid = batch["pixel_values"], batch["image_grid_thw"]
    vc = model.config.vision_config
    n_patches = int(grid.prod(-1).sum())
    with torch.no_grad():
        out = model.get_image_features(pv, grid)
        tower = model.model.vision_tower(pv, grid)
        projected = model.model.mm_projector(tower.pooler_output)
    assert isinstance(out, BaseModelOutputWithPooling) and isinstance(out.pooler_output, tuple)
    assert [f.shape for f in out.pooler_output] == [(4, 32), (2, 32), (6, 32)]  # h w / 4 per image, text hidden 32
    assert torch.equal(out.last_hidden_state, tower.last_hidden_state)
    assert torch.equal(torch.cat(out.pooler_output), projected)
    assert out.hidden_states is None and out.attentions is None
    # the features the forward writes: read at the language model's input
    seen = {}
    hook = model.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        hook.remove()
    written = seen["embeds"][batch["input_ids"] == model.config.image_token_id]
    assert torch.equal(written, torch.cat(out.pooler_output))
    with torch.no_grad():
        full = model.model.get_image_features(pv, grid, output_hidden_states=True, output_attentions=True)
        as_tuple = model.get_image_features(pv, grid, return_dict=False)
    assert len(full.hidden_states) == vc.num_hidden_layers + 1
    assert all(h.shape == (n_patches, vc.hidden_size) for h in full.hidden_states)
    assert len(full.attentions) == vc.num_hidden_layers
    assert all(a.shape == (1, vc.num_attention_heads, n_patches, n_patches) for a in full.attentions)
    assert all((x - y).abs().max() <= 1e-5 for x, y in zip(full.pooler_output, out.pooler_output))
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.last_hidden_state)
    assert all(torch.equal(x, y) for x, y in zip(as_tuple[1], out.pooler_output))


def test_experts_implementation_switches_and_router_logits_come_back(setup):
    """transformers' `_can_set_experts_implementation` looks for the experts decorator in the class's own module; the
    multimodal classes reach their decoder's experts: set_experts_implementation switches them (same logits), and
    output_router_logits returns one [tokens, experts] tensor per MoE layer with the load-balancing loss."""
    from kimi_hf.models.kimi_hybrid.modeling_kimi_hybrid import KimiHybridExperts

    model, proc = setup
    batch = proc(images=[img(56, 56)], text=prompt(proc))
    assert KimiHybridForConditionalGeneration._can_set_experts_implementation()
    experts = [m for m in model.modules() if isinstance(m, KimiHybridExperts)]
    before = model.config.get_text_config()._experts_implementation
    with torch.no_grad():
        ref = model(**batch).logits
        for impl in ("eager", "grouped_mm"):
            model.set_experts_implementation(impl)
            assert model.config.get_text_config()._experts_implementation == impl
            assert all(e.config._experts_implementation == impl for e in experts)
            torch.testing.assert_close(model(**batch).logits, ref, atol=1e-5, rtol=1e-5)
        out = model(**batch, output_router_logits=True)
    model.set_experts_implementation(before)
    sparse = model.config.get_text_config().mlp_layer_types.count("sparse")
    tokens = batch["input_ids"].numel()
    num_experts = model.config.get_text_config().num_experts
    assert sparse > 0 and len(out.router_logits) == sparse
    assert all(r.shape == (tokens, num_experts) for r in out.router_logits)
    assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
