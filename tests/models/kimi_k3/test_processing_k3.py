"""Kimi K3's image processor and processor: K3's resize budget and transparent background, the release's
preprocessor_config.json, the expansion of `<|kimi_image_placeholder|>` into K3's media block with one
`<|media_pad|>` per feature (across a batch), mismatches, AutoProcessor on a released folder and on a saved one.

Expected values are written from K3.md §3.9-3.10 and the release's processor settings (in_patch_limit 65536,
patch_limit_on_one_side 512, an 8-pixel white / gray (255 / 180) chessboard behind transparent pixels), not
computed by the code under test."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoProcessor, GenerationConfig

from kimi_hf import KimiK3ImageProcessor, KimiK3Processor

from .release_format import (
    TINY_CHAT_MEDIA_PAD_ID,
    tiny_k3_chat_config,
    write_k3_preprocessor_config,
    write_k3_tokenizer_files,
)


def rgb(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A folder with the release's tokenizer and image-processor files and a tiny K3 config.json."""
    folder = tmp_path_factory.mktemp("k3_release_files")
    write_k3_tokenizer_files(folder)
    write_k3_preprocessor_config(folder)
    (folder / "config.json").write_text(json.dumps(tiny_k3_chat_config()))
    return folder


@pytest.fixture(scope="module")
def proc(released):
    return AutoProcessor.from_pretrained(released)


# ---------------------------------------------------------------------------------------------- image processor
def test_k3_budget_counts_a_4000_by_3000_photo_at_full_resolution():
    ip = KimiK3ImageProcessor()
    # 285 x 214 patches < 65,536: no resize; padded to multiples of 28 -> 4004 x 3024 -> 143 x 108 merged tokens
    assert ip.get_number_of_image_tokens(3000, 4000) == 143 * 108
    # K2.5's budget (16,384 patches) would shrink it
    assert KimiK3ImageProcessor(max_patches=16384).get_number_of_image_tokens(3000, 4000) < 143 * 108
    # the side limit: 512 patches a side at most
    (h, w), (ph, pw) = ip.target_size(100, 20000)
    assert w <= 512 * 14 and pw // 14 <= 512


def test_release_media_proc_cfg_is_read():
    ip = KimiK3ImageProcessor(
        media_proc_cfg={
            "patch_size": 14,
            "merge_kernel_size": 2,
            "in_patch_limit": 256,
            "patch_limit_on_one_side": 16,
            "fixed_output_tokens": None,
            "temporal_merge_kernel_size": 4,  # a video setting: ignored for images
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        auto_map={"AutoImageProcessor": "kimi_k3_vision_processing.KimiK3VisionProcessor"},
    )
    assert (ip.max_patches, ip.max_patches_per_side, ip.merge_size) == (256, 16, 2)
    assert not hasattr(ip, "auto_map")
    with pytest.raises(ValueError, match="fixed_output_tokens"):
        KimiK3ImageProcessor(media_proc_cfg={"fixed_output_tokens": 64})
    with pytest.raises(ValueError, match="transparent_bg_fill_stage"):
        KimiK3ImageProcessor(transparent_bg_fill_stage="later")
    with pytest.raises(ValueError, match="pattern"):
        KimiK3ImageProcessor(transparent_bg_config={"pattern": "stripes"})


def test_transparent_pixels_show_the_chessboard():
    ip = KimiK3ImageProcessor()
    clear = Image.new("RGBA", (28, 28), (200, 10, 10, 0))  # fully transparent: only the background is left
    out = ip(images=[clear])
    x = out["pixel_values"].view(2, 2, 3, 14, 14).permute(0, 3, 1, 4, 2).reshape(28, 28, 3)
    white, gray = (255 / 255 - 0.5) / 0.5, (180 / 255 - 0.5) / 0.5
    rows, cols = np.meshgrid(np.arange(28) // 8, np.arange(28) // 8, indexing="ij")
    expected = np.where(((rows + cols) % 2 == 0)[..., None], white, gray).repeat(3, -1)
    np.testing.assert_allclose(x.numpy(), expected, atol=1e-6)
    # opaque pixels are the image's own; half transparency mixes (truncating to uint8, as K3 does)
    half = Image.new("RGBA", (28, 28), (100, 100, 100, 128))
    y = ip(images=[half])["pixel_values"][0, 0, 0, 0].item()  # top-left pixel: over white
    mixed = int(np.float32(128 / 255) * 100 + (1 - np.float32(128 / 255)) * 255)
    assert y == pytest.approx((mixed / 255 - 0.5) / 0.5, abs=1e-6)
    # K2.5's processor puts white behind every transparent pixel instead
    from kimi_hf import KimiHybridImageProcessor

    assert torch.all(KimiHybridImageProcessor()(images=[clear])["pixel_values"] == 1.0)


def test_fill_stage_only_matters_at_resampled_edges():
    image = np.zeros((40, 60, 4), np.uint8)
    image[:, :30] = (20, 200, 20, 255)  # left half opaque green, right half transparent
    before = KimiK3ImageProcessor(max_patches=4, transparent_bg_fill_stage="before_resize")(images=[image])
    after = KimiK3ImageProcessor(max_patches=4)(images=[image])
    assert before["image_grid_thw"].tolist() == after["image_grid_thw"].tolist()
    assert not torch.equal(before["pixel_values"], after["pixel_values"])


def test_auto_image_processor_saves_and_reloads(tmp_path):
    ip = KimiK3ImageProcessor(max_patches=1024, transparent_bg_fill_stage="before_resize")
    ip.save_pretrained(tmp_path)
    again = AutoImageProcessor.from_pretrained(tmp_path)
    assert type(again) is KimiK3ImageProcessor
    assert (again.max_patches, again.transparent_bg_fill_stage) == (1024, "before_resize")


# ---------------------------------------------------------------------------------------------------- processor
def test_auto_processor_reads_the_released_files(proc):
    assert type(proc) is KimiK3Processor and type(proc.image_processor) is KimiK3ImageProcessor
    assert proc.image_token_id == TINY_CHAT_MEDIA_PAD_ID
    assert proc.tokenizer.response_template is not None
    assert proc.stop_token_ids() == [258, 257]  # <|end_of_msg|>, then [EOS]


def test_placeholders_expand_to_k3_media_blocks_across_a_batch(proc):
    ph = "<|kimi_image_placeholder|>"
    images = [rgb(56, 84), rgb(28, 28), rgb(30, 50)]  # 2 x 3, 1 x 1 and (padded to 56 x 56) 2 x 2 merged tokens
    out = proc(images=images, text=[f"a{ph}b{ph}", f"c{ph}"], padding=True)
    ids, mask = out["input_ids"], out["attention_mask"].bool()
    assert (ids == TINY_CHAT_MEDIA_PAD_ID).sum(1).tolist() == [6 + 1, 4]
    assert int((ids == TINY_CHAT_MEDIA_PAD_ID).sum()) == int(out["image_grid_thw"].prod(-1).sum()) // 4
    text0 = proc.tokenizer.decode(ids[0][mask[0]], skip_special_tokens=False)
    pad = "<|media_pad|>"
    assert text0 == (
        f"a<|media_begin|>image 84x56<|media_content|>{pad * 6}<|media_end|>"
        f"b<|media_begin|>image 28x28<|media_content|>{pad}<|media_end|>"
    )
    text1 = proc.tokenizer.decode(ids[1][mask[1]], skip_special_tokens=False)
    assert text1 == f"c<|media_begin|>image 50x30<|media_content|>{pad * 4}<|media_end|>"  # original W x H


def test_k3_single_pad_prompts_are_widened_in_place(proc):
    block = "<|media_begin|>image 84x56<|media_content|><|media_pad|><|media_end|>"  # K3's own processor's form
    out = proc(images=[rgb(56, 84)], text=f"look {block}")
    text = proc.tokenizer.decode(out["input_ids"][0], skip_special_tokens=False)
    assert text == "look " + block.replace("<|media_pad|>", "<|media_pad|>" * 6)


def test_mismatches_raise(proc):
    ph = "<|kimi_image_placeholder|>"
    with pytest.raises(ValueError, match=r"2 image placeholders \(<\|kimi_image_placeholder\|>\) but 1 images"):
        proc(images=[rgb(28, 28)], text=f"{ph}{ph}")
    with pytest.raises(ValueError, match="no images"):
        proc(text=ph)
    with pytest.raises(ValueError, match="0 image placeholders"):
        proc(images=[rgb(28, 28)], text="nothing here")


def test_chat_template_with_an_image(proc):
    messages = [{"role": "user", "content": [{"type": "image", "image": rgb(28, 56)}, {"type": "text", "text": "n?"}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, thinking_effort=None)
    assert text == (
        '<|open|>message role="user"<|sep|><|kimi_image_placeholder|>n?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    out = proc.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, thinking_effort=None
    )
    assert out["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert out["input_ids"][0].count(TINY_CHAT_MEDIA_PAD_ID) == 2  # lists: no return_tensors was given
    decoded = proc.tokenizer.decode(out["input_ids"][0], skip_special_tokens=False)
    assert "<|media_begin|>image 56x28<|media_content|>" in decoded


def test_trls_stop_token_check_reads_the_processor(proc):
    """TRL's SFTTrainer checks, given the processor, that the template's assistant mask ends on the end-of-turn
    token; it reads apply_chat_template(tokenize=True) as lists (as transformers' processors return them) and warned
    falsely that the model may not learn to stop when it got tensors."""
    chat_template_utils = pytest.importorskip("trl.chat_template_utils")
    assert chat_template_utils.is_chat_template_stop_token_trained(proc)


def test_saved_processor_reloads_and_makes_the_model_stop_at_end_of_msg(proc, tmp_path):
    GenerationConfig(eos_token_id=258).save_pretrained(tmp_path)  # a model saved in the same folder
    proc.save_pretrained(tmp_path)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [258, 257]
    again = AutoProcessor.from_pretrained(tmp_path)
    assert type(again) is KimiK3Processor
    messages = [{"role": "user", "content": "hi"}]
    assert again.apply_chat_template(messages, tokenize=False) == proc.apply_chat_template(messages, tokenize=False)
    assert again.tokenizer.convert_tokens_to_ids("<|close|>") == 260
    assert again.tokenizer.decode([260, 261], skip_special_tokens=True) == "<|close|><|sep|>"  # not special


@pytest.mark.parametrize("thinking", [True, False])
def test_collator_labels_are_the_templates_generation_spans(proc, thinking):
    """The fine-tuning collator's labels on K3's markup: exactly what the chat template marks as the assistant's
    own tokens ({% generation %}: after the generation prompt, through <|end_of_msg|>), over two turns; with an
    image, never the image's pads."""
    from kimi_hf.collators import IGNORE_INDEX, KimiHybridVisionCollator

    options = {"thinking_effort": None, "enable_thinking": thinking}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "reasoning_content": "hm"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
    ]
    collator = KimiHybridVisionCollator(proc, chat_template_kwargs=options)
    batch = collator([{"messages": messages}])
    enc = proc.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **options
    )
    assert batch["input_ids"][0].tolist() == enc["input_ids"]
    assert (batch["labels"][0] != IGNORE_INDEX).int().tolist() == enc["assistant_masks"]
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}, messages[-1]]
    batch = collator([{"messages": with_image, "images": [rgb(56, 56)]}])
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    assert (ids == TINY_CHAT_MEDIA_PAD_ID).sum() == 4 and (labels[ids == TINY_CHAT_MEDIA_PAD_ID] == IGNORE_INDEX).all()
    reply = proc.tokenizer.decode(ids[labels != IGNORE_INDEX], skip_special_tokens=False)
    assert reply.endswith("ok<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
