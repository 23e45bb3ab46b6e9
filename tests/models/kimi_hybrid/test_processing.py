"""KimiHybridProcessor: placeholder expansion, batches with different image counts, the chat
template with images, mismatches, save/load; the fine-tuning collator's labels."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from kimi_hf import KimiHybridProcessor
from kimi_hf.collators import IGNORE_INDEX, KimiHybridVisionCollator

from .helpers import tiny_multimodal_config, tiny_processor


def img(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def test_each_placeholder_expands_to_its_images_tokens_in_order():
    proc = tiny_processor()
    pad = proc.image_token
    out = proc(
        images=[img(56, 84), img(28, 28), img(56, 56)],  # 6, 1 and 4 merged tokens
        text=[f"first {pad} then {pad}", f"only {pad} here"],
        padding=True,
    )
    ids = out["input_ids"]
    counts = (ids == proc.image_token_id).sum(1).tolist()
    assert counts == [7, 4]
    assert out["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2], [1, 4, 4]]
    row0 = ids[0][out["attention_mask"][0].bool()].tolist()  # the first image's 6 tokens come first, contiguous
    first = row0.index(proc.image_token_id)
    assert row0[first : first + 6] == [proc.image_token_id] * 6 and row0[first + 6] != proc.image_token_id
    assert proc.num_image_tokens(56, 84) == 6


def test_mismatched_placeholders_and_images_raise():
    proc = tiny_processor()
    with pytest.raises(ValueError, match="2 image placeholders .* 1 images"):
        proc(images=[img(28, 28)], text=[f"{proc.image_token} {proc.image_token}"])
    with pytest.raises(ValueError, match="no images"):
        proc(text=f"a {proc.image_token}")
    with pytest.raises(ValueError, match="0 image placeholders"):
        proc(images=[img(28, 28)], text="no placeholder")


def test_chat_template_with_images_tokenizes():
    proc = tiny_processor()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": img(56, 56)}, {"type": "text", "text": "how many circles?"}],
        }
    ]
    text = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
        "how many circles?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    out = proc.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    # lists without return_tensors, as a tokenizer's template gives (the images' arrays stay tensors)
    assert isinstance(out["input_ids"], list) and out["input_ids"][0].count(proc.image_token_id) == 4
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]
    pt = proc.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )
    assert pt["input_ids"].tolist() == out["input_ids"]


def test_save_and_load_through_auto_processor(tmp_path):
    proc = tiny_processor()
    proc.save_pretrained(tmp_path)
    tiny_multimodal_config().save_pretrained(tmp_path)
    loaded = AutoProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, KimiHybridProcessor)
    a = proc(images=[img(56, 56)], text=f"x {proc.image_token}")
    b = loaded(images=[img(56, 56)], text=f"x {proc.image_token}")
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])


def test_collator_masks_prompt_padding_and_image_tokens():
    proc = tiny_processor()
    collate = KimiHybridVisionCollator(proc)
    q = [{"type": "image"}, {"type": "text", "text": "how many?"}]
    examples = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "3"}], "images": [img(56, 56)]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    ]
    batch = collate(examples)
    labels, ids = batch["labels"], batch["input_ids"]
    assert batch["pixel_values"].shape[0] == 16 and labels.shape == ids.shape
    tok = proc.tokenizer
    for row in range(2):
        kept = ids[row][labels[row] != IGNORE_INDEX].tolist()
        reply = examples[row]["messages"][1]["content"]
        assert tok.decode(kept) == reply + "<|im_end|>"  # exactly the reply and its end marker
    assert not ((ids == proc.image_token_id) & (labels != IGNORE_INDEX)).any()
    everything = KimiHybridVisionCollator(proc, train_on="all")(examples)["labels"]
    assert (everything != IGNORE_INDEX).sum() > (labels != IGNORE_INDEX).sum()
    with pytest.raises(ValueError, match="train_on"):
        KimiHybridVisionCollator(proc, train_on="prompt")
