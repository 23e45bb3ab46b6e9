"""The README's Python snippets run as written (a newcomer copies them): the hybrid model's, and the early-fusion
one on a small saved model of this package (the folder `path` and `scene.png` it names are made here)."""

import ast
import contextlib
import io
import random
import re
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, GenerationConfig

from kimi_hf.presets import small_multimodal_model
from kimi_hf.scenes import render_scene

from .models.kimi_hybrid.helpers import tiny_processor


README = Path(__file__).resolve().parent.parent / "README.md"


def snippet(heading: str, index: int = 0) -> str:
    """The `index`-th ```python block after `heading` (0: the first)."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    return re.findall(r"```python\n(.*?)```", section, re.S)[index]


def test_hybrid_model_snippet_builds_the_small_model_it_shows():
    scope: dict = {}
    exec(compile(snippet("## The hybrid model"), "README.md", "exec"), scope)
    model = scope["model"]
    n = sum(p.numel() for p in model.parameters())
    shown = re.search(r"KimiHybridForCausalLM, ([\d.]+)M parameters", snippet("## The hybrid model")).group(1)
    assert round(n / 1e6, 1) == float(shown)
    assert torch.isfinite(scope["out"].loss) and model.config.layer_types.count("linear_attention") == 3


def early_fusion_folder(tmp_path, arch: str):
    """A small saved model as the quickstart saves it (K3: its default architecture; Kimi Linear) with its
    processor, and the image the snippet names; the K3 model is made (sequence_bias) to write a K3 reply with a
    think channel and an answer, so that the parsed reply shows both."""
    torch.manual_seed(0)
    path = tmp_path / "model"
    image = render_scene(random.Random(0), 28, circles=2)
    image.save(tmp_path / "scene.png")
    if arch == "kimi-linear":
        proc = tiny_processor()
        small_multimodal_model(proc.tokenizer, "tiny", image_size=28).save_pretrained(path)
        proc.save_pretrained(path)
        return path, proc, None
    from kimi_hf import KimiK3ImageProcessor, KimiK3Processor
    from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import render_k3_reply
    from kimi_hf.presets import small_k3_model
    from kimi_hf.quickstart import markup_text
    from kimi_hf.tokenization import train_tokenizer

    question = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles are there?"}]}
    ]
    reply = render_k3_reply("2", reasoning_content="Two round shapes.")
    corpus = markup_text([[*question, {"role": "assistant", "content": ""}]], {}) + [reply]
    proc = KimiK3Processor(KimiK3ImageProcessor(), train_tokenizer(corpus, vocab_size=400, markup="k3"))
    small_k3_model(proc.tokenizer, "tiny", image_size=28).save_pretrained(path)
    proc.save_pretrained(path)
    prompt = proc.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    expanded = proc(images=[image], text=[prompt], return_tensors="pt")["input_ids"][0].tolist()
    config = GenerationConfig.from_pretrained(path)
    ids = proc.tokenizer(reply, add_special_tokens=False)["input_ids"]
    # each reply token forced after the prompt's last 12 tokens and the reply so far (JSON: lists, not tuples)
    config.sequence_bias = [[expanded[-12:] + ids[: i + 1], 100.0] for i in range(len(ids))]
    config.save_pretrained(path)
    return path, proc, {"role": "assistant", "reasoning_content": "Two round shapes.", "content": "2"}


@pytest.mark.parametrize("arch", ["k3", "kimi-linear"])
def test_early_fusion_snippet_prints_the_parsed_reply(tmp_path, monkeypatch, arch):
    """On the quickstart's default model (K3) the snippet prints K3's parsed reply (think channel and answer), not
    half-stripped markup (`<|close|>` / `<|sep|>` are not special in K3's tokenizer); on Kimi Linear its reply."""
    path, proc, expected = early_fusion_folder(tmp_path, arch)
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet("## Early fusion"), "README.md", "exec"), {"path": str(path)})
    out = printed.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1 and "<|" not in out, out
    # the reply greedy generation gives on the image and question fed through the processor directly
    model = AutoModelForImageTextToText.from_pretrained(path)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles are there?"}]}
    ]
    prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = proc(images=[Image.open(tmp_path / "scene.png")], text=[prompt], return_tensors="pt")
    ids = model.generate(**inputs, max_new_tokens=32)[0, inputs["input_ids"].shape[1] :]
    parsed = proc.parse_response(ids, prefix=inputs["input_ids"][0])
    assert ast.literal_eval(out) == parsed  # the printed dict (its key order is the parser's)
    if expected is not None:
        assert parsed == expected


def test_k3_snippet_loads_a_released_layout_folder_and_saves_it_back(tmp_path):
    from .models.kimi_k3.release_format import tiny_k3_config, write_k3_checkpoint

    write_k3_checkpoint(tmp_path / "k3", tiny_k3_config(), seed=0)
    scope = {"k3_dir": str(tmp_path / "k3"), "out_dir": str(tmp_path / "out")}
    exec(compile(snippet("## Kimi K3"), "README.md", "exec"), scope)
    assert scope["cfg"].model_type == "kimi_k3"
    assert type(scope["model"]).__name__ == type(scope["text"]).__name__ == "KimiK3ForConditionalGeneration"
    assert type(scope["base"]).__name__ == "KimiK3Model"
    # the released layout again: the same tensors by name, dtype and shape, the unquantized ones unchanged (the
    # MXFP4 experts' bytes may encode the same values another way: a block's scale one step apart)
    source, saved = released_tensors(tmp_path / "k3"), released_tensors(tmp_path / "out")
    assert {k: (t.dtype, t.shape) for k, t in saved.items()} == {k: (t.dtype, t.shape) for k, t in source.items()}
    assert all(torch.equal(saved[k], t) for k, t in source.items() if t.dtype != torch.uint8)
    assert (tmp_path / "out" / "config.json").exists()


def released_tensors(folder: Path) -> dict:
    """Every tensor of a folder's safetensors shards, by name."""
    from safetensors.torch import load_file

    return {k: t for shard in sorted(folder.glob("*.safetensors")) for k, t in load_file(shard).items()}


def test_k3_chat_snippet_answers_about_an_image_on_a_released_folder(tmp_path, monkeypatch):
    from .models.kimi_k3.release_format import (
        tiny_k3_chat_config,
        write_k3_checkpoint,
        write_k3_preprocessor_config,
        write_k3_tokenizer_files,
    )

    folder = tmp_path / "k3"
    write_k3_checkpoint(folder, tiny_k3_chat_config(), seed=0)
    write_k3_tokenizer_files(folder)
    write_k3_preprocessor_config(folder)
    render_scene(random.Random(0), 56, circles=2).save(tmp_path / "scene.png")
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(snippet("## Kimi K3", index=1), "README.md", "exec"), {"k3_dir": str(folder)})
    out = printed.getvalue()
    assert out.startswith("{'role': 'assistant', 'reasoning_content': ") and out.count("\n") == 1
