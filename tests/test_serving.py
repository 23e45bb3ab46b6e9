"""`kimi-hf serve` (kimi_hf.serving): transformers serve on 127.0.0.1 for the multimodal quickstart-style
model (text and image chat requests through the OpenAI API, an alias name), for a text model saved beside
a processor, and for a tiny Kimi K3 model (the quickstart's default architecture) with its processor, through
the OpenAI python client: text, an image, streaming, a tool call parsed from K3's markup and the turn after the
tool's result; start-up errors are one line.

The saved generation configs carry a `sequence_bias` that makes the untrained models write a chosen reply
and then <|im_end|> (K3: its reply markup, ending with <|end_of_msg|>), keyed on the end of the prompt that
the server renders: a server that did not stop at the end of the turn would return more text, and one that
built another prompt (another chat template, a lost image or tool message) would not get the reply."""

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

from kimi_hf import KimiHybridForCausalLM, KimiK3ImageProcessor, KimiK3Processor
from kimi_hf.chat import chat_stop_token_ids
from kimi_hf.models.hub_kimi import AUTO_MAPS
from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import render_k3_reply
from kimi_hf.quickstart import markup_text, small_k3_model, small_multimodal_model
from kimi_hf.scenes import render_scene
from kimi_hf.tokenization import train_tokenizer

from .chat_helpers import reply_bias
from .models.kimi_hybrid.helpers import tiny_config, tiny_processor


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
        with urllib.request.urlopen(f"{url}/models", timeout=30) as r:  # the alias, as vLLM lists served names
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["my-model"]
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


def truncated_model(tmp_path):
    """A saved text model whose model.safetensors lost its last 100 bytes (an interrupted copy)."""
    path = tmp_path / "cut"
    KimiHybridForCausalLM(tiny_config()).save_pretrained(path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return path


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
        (  # one of the package's model types, but a part without a generation head
            lambda p: (
                (p / "vt").mkdir()
                or (p / "vt" / "config.json").write_text('{"model_type": "kimi_k3_vision"}')
                and p / "vt"
            ),
            "model_type 'kimi_k3_vision', not one this accepts",
        ),
        (  # a truncated weights file: named, with its byte counts (the check every loading command shares)
            truncated_model,
            "model.safetensors: truncated",
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


def test_check_model_dir_accepts_every_model_type_with_a_generation_class(tmp_path):
    """The served model types are AUTO_MAPS' entries with a generation class (Kimi K3 among them); any other
    model type is refused in one line naming them."""
    from kimi_hf.serving import check_model_dir, served_model_types

    assert list(served_model_types()) == [t for t, entries in AUTO_MAPS.items() if "AutoModelForCausalLM" in entries]
    assert {"kimi_hybrid_text", "kimi_hybrid", "kimi_k3"} <= set(served_model_types())
    for model_type in [*served_model_types(), "llama", "kimi_hybrid_vision"]:
        (tmp_path / model_type).mkdir()
        (tmp_path / model_type / "config.json").write_text(json.dumps({"model_type": model_type}))
        if model_type in served_model_types():
            check_model_dir(str(tmp_path / model_type))
            continue
        with pytest.raises(ValueError) as e:
            check_model_dir(str(tmp_path / model_type))
        message = str(e.value)
        assert "\n" not in message and f"model_type {model_type!r}" in message and "kimi_k3" in message


# ----------------------------------------------------------------------------------------------------------------
# Kimi K3 (the quickstart's default model): a tiny K3 model and a K3-markup tokenizer, served through the OpenAI
# python client
# ----------------------------------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
K3_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
K3_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
K3_ANSWER = "It is 18C in Paris."


def k3_replies(image_url: str) -> list[tuple[list[dict], list | None, str]]:
    """(OpenAI messages, tools, the reply K3 writes) for each request the K3 tests make. The tool call's id and
    the assistant message's content do not reach K3's prompt (the template names results by their call)."""
    called = {"role": "assistant", "content": None, "tool_calls": [{"id": "any", **K3_CALL}]}
    tool = {"role": "tool", "tool_call_id": "any", "content": "18C"}
    image_question = [
        {"type": "image_url", "image_url": {"url": image_url}},
        {"type": "text", "text": "How many circles?"},
    ]
    return [
        ([{"role": "user", "content": "Say yes."}], None, render_k3_reply("yes")),
        ([{"role": "user", "content": image_question}], None, render_k3_reply("2")),
        (K3_ASK, [WEATHER], render_k3_reply(tool_calls=[K3_CALL], reasoning_content="Need the weather.")),
        ([*K3_ASK, called, tool], [WEATHER], render_k3_reply(K3_ANSWER)),
    ]


def k3_processor(requests) -> KimiK3Processor:
    """KimiK3Processor with K3's XTML chat markup over a byte-level BPE trained, as the quickstart trains one, on
    the markup of these requests' conversations and their replies."""
    rendered = [[*messages, {"role": "assistant", "content": ""}] for messages, _, _ in requests]
    corpus = markup_text(rendered, {"thinking_effort": None, "tools": [WEATHER]})
    corpus += [reply for _, _, reply in requests]
    return KimiK3Processor(KimiK3ImageProcessor(), train_tokenizer(corpus, vocab_size=400, markup="k3"))


def k3_prompt_ids(processor, messages, tools=None, text_only: bool = False) -> list[int]:
    """The prompt the server builds for these OpenAI messages: transformers serve's own message conversion (a
    multimodal model's, or a text model's), then the chat template of the processor (a text model: of its
    tokenizer) with its defaults."""
    from transformers.cli.serving.utils import BaseHandler, Modality

    inputs = BaseHandler.get_processor_inputs_from_messages(messages, Modality.LLM if text_only else Modality.VLM)
    processor = processor.tokenizer if text_only else processor
    ids = processor.apply_chat_template(
        inputs, add_generation_prompt=True, tools=tools, tokenize=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    return ids[0].tolist()


def force_k3_replies(path, processor, requests, text_only: bool = False, context: int = 24) -> None:
    """sequence_bias that makes each prompt continue with its K3 reply; keyed on the prompt's last `context`
    tokens (K3's generation prompt alone is about a dozen: the keys reach into the last message)."""
    tok = processor.tokenizer
    bias, heads = {}, set()
    for messages, tools, reply in requests:
        head = k3_prompt_ids(processor, messages, tools, text_only)[-context:]
        heads.add(tuple(head))
        ids = tok(reply, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=False) == reply
        bias.update({tuple(head + ids[: i + 1]): 100.0 for i in range(len(ids))})
    assert len(heads) == len(requests)  # each prompt gets its own reply
    config = GenerationConfig.from_pretrained(path)
    config.sequence_bias = [[list(k), v] for k, v in bias.items()]
    config.save_pretrained(path)


@pytest.fixture(scope="module")
def k3_server(tmp_path_factory):
    """A tiny random KimiK3ForConditionalGeneration saved with its KimiK3Processor (K3's XTML chat markup, a
    byte-level BPE trained on that markup as the quickstart trains one), served on 127.0.0.1."""
    openai = pytest.importorskip("openai")
    image_url = data_url(render_scene(random.Random(0), 28, circles=2))
    requests = k3_replies(image_url)
    processor = k3_processor(requests)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("k3") / "model"
    small_k3_model(processor.tokenizer, "tiny", image_size=28).save_pretrained(path)
    processor.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "kimi_k3"
    force_k3_replies(path, processor, requests)
    server, url = start(path)
    try:
        yield (
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120),
            str(path),
            processor,
            image_url,
        )
    finally:
        print(stop(server))


def test_k3_text_chat(k3_server):
    client, model, _, _ = k3_server
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say yes."}], max_tokens=40, temperature=0
    )
    choice = reply.choices[0]
    assert choice.message.content == "yes" and choice.finish_reason == "stop" and not choice.message.tool_calls
    # K3's (empty) think channel is parsed out of the content; the server leaves an empty reasoning out
    assert (choice.message.model_extra or {}).get("reasoning_content") in (None, "")


def test_k3_image_as_a_data_url(k3_server):
    client, model, processor, image_url = k3_server
    messages = k3_replies(image_url)[1][0]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0)
    assert reply.choices[0].message.content == "2" and reply.choices[0].finish_reason == "stop"
    # the image reached the processor: the prompt holds its media block (one <|media_pad|> per merged patch group)
    prompt = k3_prompt_ids(processor, messages)
    pad = processor.tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert reply.usage.prompt_tokens == len(prompt) and prompt.count(pad) > 0


def test_k3_streaming(k3_server):
    client, model, _, _ = k3_server
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say yes."}], max_tokens=40, temperature=0, stream=True
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "yes" and chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[0].choices[0].delta.role == "assistant"


def test_k3_tool_call_then_the_turn_after_the_tool_result(k3_server):
    client, model, _, _ = k3_server
    reply = client.chat.completions.create(model=model, messages=K3_ASK, tools=[WEATHER], max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert (
        choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning_content"] == "Need the weather."
    )
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    streamed = list(
        client.chat.completions.create(
            model=model, messages=K3_ASK, tools=[WEATHER], max_tokens=80, temperature=0, stream=True
        )
    )
    calls = [t for c in streamed if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get_weather", {"city": "Paris"})]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"

    # the next turn: the assistant's call as the server returned it, then the tool's result
    messages = [
        *K3_ASK,
        {"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18C"},
    ]
    after = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=80, temperature=0
    ).choices[0]
    assert after.message.content == K3_ANSWER and after.finish_reason == "stop" and not after.message.tool_calls


def test_serves_a_k3_text_model_saved_beside_a_processor(tmp_path):
    """Kimi K3's text-only model (kimi_k3_text: KimiK3ForCausalLM) is served as a text model: its tokenizer, not
    the multimodal processor named in tokenizer_config.json; a tool call in K3's markup comes back parsed."""
    openai = pytest.importorskip("openai")
    from kimi_hf import KimiK3ForCausalLM

    requests = [k3_replies("")[0], k3_replies("")[2]]
    processor = k3_processor(requests)
    tok = processor.tokenizer
    torch.manual_seed(0)
    path = tmp_path / "k3_text"
    KimiK3ForCausalLM(small_k3_model(tok, "tiny", image_size=28).config.text_config).save_pretrained(path)
    processor.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "kimi_k3_text"
    force_k3_replies(path, processor, requests, text_only=True)
    server, url = start(path)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=str(path), messages=requests[0][0], max_tokens=40, temperature=0
        ).choices[0]
        assert reply.message.content == "yes" and reply.finish_reason == "stop"
        call = client.chat.completions.create(
            model=str(path), messages=K3_ASK, tools=[WEATHER], max_tokens=80, temperature=0
        ).choices[0]
        assert call.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in call.message.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
    finally:
        print(stop(server))


# ----------------------------------------------------------------------------------------------------------------
# --adapter: a PEFT LoRA adapter (here in Kimi K3's released names) merged into the model when it loads
# ----------------------------------------------------------------------------------------------------------------
def test_serves_a_k3_model_with_a_released_adapter_merged_at_load(tmp_path):
    """A tiny KimiK3ForConditionalGeneration folder and a LoRA adapter over it saved in the release's module names
    (kimi_hf.adapters_released): transformers serve has no adapters, so `--adapter` merges it when the model loads.
    The reply is the merged model's greedy continuation of the prompt the server builds, which is not the base
    model's. Every added token is suppressed (generation_config.json, read by both), so the untrained models write
    eight plain tokens: no markup for the server's parser to act on."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from kimi_hf import K3_LORA_TARGET_MODULES, KimiK3ForConditionalGeneration
    from kimi_hf.adapters_released import save_released_adapter
    from kimi_hf.presets import small_k3_config

    processor = tiny_processor()
    tok = processor.tokenizer
    torch.manual_seed(0)
    config = small_k3_config(
        vocab_size=len(tok),
        media_token_id=tok.convert_tokens_to_ids("<|media_pad|>"),
        bos_token_id=tok.bos_token_id,
        eos_token_id=chat_stop_token_ids(tok)[0],
        pad_token_id=tok.pad_token_id,
    )
    path, adapter = tmp_path / "k3", tmp_path / "adapter"
    KimiK3ForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)
    generation = GenerationConfig.from_pretrained(path)
    generation.suppress_tokens = sorted(tok.added_tokens_decoder)
    generation.save_pretrained(path)
    lora = LoraConfig(r=4, lora_alpha=64, target_modules=K3_LORA_TARGET_MODULES, init_lora_weights=False)
    save_released_adapter(get_peft_model(KimiK3ForConditionalGeneration.from_pretrained(path), lora), str(adapter))

    messages = [{"role": "user", "content": "Say yes."}]
    prompt = torch.tensor([k3_prompt_ids(processor, messages)])

    def greedy(model) -> str:
        with torch.no_grad():
            out = model.eval().generate(prompt, max_new_tokens=8, do_sample=False)
        return tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)

    with_adapter = PeftModel.from_pretrained(KimiK3ForConditionalGeneration.from_pretrained(path), str(adapter))
    expected = greedy(with_adapter.merge_and_unload())
    assert expected != greedy(KimiK3ForConditionalGeneration.from_pretrained(path))  # the adapter decides it
    server, url = start(path, "--adapter", str(adapter))
    try:
        reply = chat(url, str(path), "Say yes.", max_tokens=8)["choices"][0]
        assert reply["message"]["content"] == expected and reply["finish_reason"] == "length"
    finally:
        print(stop(server))


def test_adapter_start_up_errors_are_one_line(tmp_path):
    path = tmp_path / "good"
    KimiHybridForCausalLM(tiny_config()).save_pretrained(path)
    (tmp_path / "not_an_adapter").mkdir()
    for adapter, message in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "not_an_adapter", "no adapter_config.json"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "kimi_hf.cli", "serve", str(path), "--adapter", str(adapter)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
