"""`kimi-hf serve` (kimi_hf.serving): transformers serve on 127.0.0.1 for the multimodal quickstart-style
model (text and image chat requests through the OpenAI API, an alias name) and for a text model saved beside
a processor; start-up errors are one line.

The saved generation configs carry a `sequence_bias` that makes the untrained models write a chosen reply
and then <|im_end|>: a server that did not stop at the end of the turn would return more text."""

import base64
import io
import json
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import GenerationConfig

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.chat import chat_stop_token_ids
from kimi_hf.quickstart import small_multimodal_model
from kimi_hf.scenes import render_scene

from .models.kimi_hybrid.helpers import tiny_config, tiny_processor
from .test_chat import reply_bias


pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

SERVER = [sys.executable, "-m", "kimi_hf.serving"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(path, *extra):
    port = free_port()
    proc = subprocess.Popen(
        [*SERVER, str(path), "--port", str(port), "--device", "cpu", "--dtype", "float32", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail("the server exited:\n" + proc.stdout.read()[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if time.time() > deadline:
                proc.kill()
                pytest.fail("the server was not ready within 180 s")
            time.sleep(0.5)


def stop(proc) -> str:
    """Stops the server; returns its output (shown when a test fails)."""
    proc.terminate()
    try:
        return proc.communicate(timeout=30)[0][-4000:]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0][-4000:]


def chat(url, model, content, max_tokens=8):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": False,
    }
    req = urllib.request.Request(
        f"{url}/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def force_replies(path, tok, prompts, replies):
    config = GenerationConfig.from_pretrained(path)
    # the list form: JSON has no tuple keys
    config.sequence_bias = [[list(k), v] for k, v in reply_bias(tok, prompts, replies).items()]
    config.save_pretrained(path)


def test_serves_the_multimodal_model_text_and_image_requests_and_an_alias(tmp_path):
    proc_ = tiny_processor()
    tok = proc_.tokenizer
    torch.manual_seed(0)
    path = tmp_path / "model"
    small_multimodal_model(tok, "tiny", image_size=28).save_pretrained(path)
    proc_.save_pretrained(path)
    image = render_scene(random.Random(0), 28, circles=2)
    text_prompt = proc_.apply_chat_template(
        [{"role": "user", "content": "Say yes."}], tokenize=False, add_generation_prompt=True
    )
    image_prompt = proc_.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many circles?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    force_replies(path, tok, [text_prompt, image_prompt], ["yes", "2"])
    server, url = start(path, "--served-model-name", "my-model")
    try:
        reply = chat(url, str(path), "Say yes.")["choices"][0]
        assert reply["message"]["content"] == "yes" and reply["finish_reason"] == "stop"
        parts = [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": "How many circles?"},
        ]
        assert chat(url, "my-model", parts)["choices"][0]["message"]["content"] == "2"
        with pytest.raises(urllib.error.HTTPError) as e:
            chat(url, "another-model", "Say yes.")
        assert e.value.code == 400
    finally:
        print(stop(server))


def test_serves_a_text_model_saved_beside_a_processor(tmp_path):
    proc_ = tiny_processor()
    tok = proc_.tokenizer
    torch.manual_seed(0)
    path = tmp_path / "text"
    KimiHybridForCausalLM(
        tiny_config(
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=chat_stop_token_ids(tok),
        )
    ).save_pretrained(path)
    proc_.save_pretrained(path)  # tokenizer_config.json now names processor_class and its auto_map
    assert "processor_class" in json.loads((path / "tokenizer_config.json").read_text())
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hello?"}], tokenize=False, add_generation_prompt=True
    )
    force_replies(path, tok, [prompt], ["hi there"])
    server, url = start(path)
    try:
        assert chat(url, str(path), "Hello?")["choices"][0]["message"]["content"] == "hi there"
    finally:
        print(stop(server))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "does" / "not" / "exist", "does not exist"),
        (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "is a file"),
        (
            lambda p: (
                (p / "cfg").mkdir() or (p / "cfg" / "config.json").write_text('{"model_type": "llama"}') and p / "cfg"
            ),
            "model_type 'llama'",
        ),
    ],
)
def test_start_up_errors_are_one_line(tmp_path, make, message):
    r = subprocess.run(
        [sys.executable, "-m", "kimi_hf.cli", "serve", str(make(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and message in r.stderr
    assert "Traceback" not in r.stderr, r.stderr
