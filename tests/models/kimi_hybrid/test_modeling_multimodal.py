"""KimiHybridForConditionalGeneration: early fusion (features at the placeholders), text-only input,
clear errors, generate() (images encoded once; equals repeated full forwards; batched with left
padding), Auto classes and save/load, the image-text-to-text pipeline, PEFT LoRA, Trainer."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Trainer, TrainingArguments, pipeline

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
        model(input_ids=torch.tensor([ids]), pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
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
            nxt = model(input_ids=seq, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"]).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], 1)
    assert torch.equal(out, seq)


def test_batched_generation_with_left_padding_and_different_image_counts(setup):
    model, proc = setup
    assert proc.tokenizer.padding_side == "left"  # train_tokenizer's default, for generation
    texts = [prompt(proc, "two?", images=2), prompt(proc, "one?")]
    images = [img(56, 56, 3), img(28, 56, 4), img(56, 28, 5)]
    batch = proc(images=images, text=texts, padding=True)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)[:, batch["input_ids"].shape[1]:]
    singles = [model.generate(**proc(images=ims, text=t), max_new_tokens=4, do_sample=False)[0, -4:]
               for t, ims in zip(texts, [images[:2], images[2:]])]
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
    messages = [{"role": "user", "content": [{"type": "image", "image": img(56, 56)}, {"type": "text", "text": "count"}]}]
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
    examples = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]},
                              {"role": "assistant", "content": str(i)}], "images": [img(28, 28, i)]} for i in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                             report_to=[], remove_unused_columns=False, use_cpu=True, save_strategy="no")
    before = {n: p.detach().clone() for n, p in lora.named_parameters() if p.requires_grad}
    trainer = Trainer(model=lora, args=args, train_dataset=examples, data_collator=KimiHybridVisionCollator(proc))
    result = trainer.train()
    assert np.isfinite(result.training_loss)
    assert any(not torch.equal(p, before[n]) for n, p in lora.named_parameters() if p.requires_grad)
