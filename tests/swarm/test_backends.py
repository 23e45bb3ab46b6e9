"""The transformers backend (batched generation across concurrent sub-agents) and the OpenAI-compatible
HTTP backend against a real `transformers serve` on 127.0.0.1 serving a tiny model of this package."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from kimi_hf import KimiHybridForCausalLM
from kimi_hf.swarm import (
    OpenAIBackend,
    ScriptedBackend,
    Swarm,
    SwarmConfig,
    TransformersBackend,
    format_tool_calls,
    run_single_agent,
)

from ..models.kimi_hybrid.helpers import tiny_config, tiny_tokenizer
from .helpers import fan_out_orchestrator, lookup


def tiny_chat_model():
    # a fresh one: the cached tokenizer has been saved with a processor by other tests, which makes it save
    # processor_class=KimiHybridProcessor (the server would then build the multimodal processor)
    tok = tiny_tokenizer.__wrapped__()
    torch.manual_seed(0)
    model = KimiHybridForCausalLM(
        tiny_config(
            vocab_size=len(tok),
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    ).eval()
    return model, tok


def forcing_bias(tok, text: str) -> dict:
    """generate(sequence_bias=...) that makes an untrained model write `text` and then <|im_end|>."""
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    return {tuple(ids[: i + 1]): 100.0 * (i + 1) for i in range(len(ids))}


def test_concurrent_subagents_are_batched_and_match_unbatched_generation():
    model, tok = tiny_chat_model()
    batched = TransformersBackend(model, tok, max_new_tokens=6, batch_window=0.05)
    result = Swarm(ScriptedBackend(fan_out_orchestrator(4)), batched, max_concurrency=4).run("t")
    assert result.status == "finished"
    assert max(batched.batch_sizes) > 1 and sum(batched.batch_sizes) == 4
    # each sub-agent's answer equals its own unbatched greedy generation (left padding changes nothing)
    single = TransformersBackend(model, tok, max_new_tokens=6, max_batch_size=1)
    answers = result.answer.split(" | ")
    for i, answer in enumerate(answers):
        alone = run_single_agent(single, f"item {i} turn 0", system_prompt=SwarmConfig().subagent_prompt, max_steps=1)
        assert alone.answer == answer
    steps = [e for e in result.trace.events if e["type"] == "step" and e["role"] == "subagent"]
    assert all(e["prompt_tokens"] > 0 and 0 < e["completion_tokens"] <= 6 for e in steps)


def test_model_tool_calls_are_parsed_with_the_response_template():
    model, tok = tiny_chat_model()
    text = format_tool_calls([("lookup", {"key": "alpha"})])
    backend = TransformersBackend(model, tok, max_new_tokens=40, sequence_bias=forcing_bias(tok, text))
    result = run_single_agent(backend, "find alpha", tools=[lookup], max_steps=2)
    step = result.trace.events[0]
    assert step["tool_calls"] == ["lookup"]
    assert result.messages[2]["tool_calls"][0]["function"]["arguments"] == {"key": "alpha"}
    assert result.messages[3] == {
        "role": "tool",
        "tool_call_id": "functions.lookup:0",
        "name": "lookup",
        "content": "value of alpha",
    }
    assert result.status == "orchestrator_step_budget"  # the forced model keeps calling


SERVER = "import sys; from kimi_hf.serving import main; main(sys.argv[1:])"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    model, tok = tiny_chat_model()
    path = str(tmp_path_factory.mktemp("served") / "tiny-kimi")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, path, "--port", str(port), "--device", "cpu", "--dtype", "float32"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail("the server exited:\n" + proc.stdout.read()[-3000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server was not ready within 180 s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1", path, model, tok
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_http_backend_plain_and_tool_calls(served_model):
    url, path, model, tok = served_model
    plain = OpenAIBackend(url, path, max_tokens=5, timeout=60)
    result = run_single_agent(plain, "hello", max_steps=1)
    assert result.status == "finished" and isinstance(result.answer, str)
    step = result.trace.events[0]
    assert step["prompt_tokens"] > 0 and 0 < step["completion_tokens"] <= 5
    assert plain.requests == 1

    # the server parses the tool call (tokenizer.response_template) into the reply's tool_calls
    text = format_tool_calls([("lookup", {"key": "alpha"})])
    bias = [[list(k), v] for k, v in forcing_bias(tok, text).items()]
    forced = OpenAIBackend(
        url,
        path,
        max_tokens=40,
        timeout=60,
        generation_config=json.dumps({"max_new_tokens": 40, "do_sample": False, "sequence_bias": bias}),
    )
    result = run_single_agent(forced, "find alpha", tools=[lookup], max_steps=2)
    assert result.trace.events[0]["tool_calls"] == ["lookup"]
    assert result.messages[3]["content"] == "value of alpha"
    assert forced.requests == 2  # the second request carried the assistant's tool call and the tool result back


def test_http_backend_as_subagents_in_parallel(served_model):
    url, path, _, _ = served_model
    sub = OpenAIBackend(url, path, max_tokens=3, timeout=60, max_connections=3)
    result = Swarm(ScriptedBackend(fan_out_orchestrator(3)), sub, max_concurrency=3).run("t")
    assert result.status == "finished" and result.metrics["finished_tasks"] == 3 and sub.requests == 3


def test_http_errors_are_backend_errors(served_model):
    url, _, _, _ = served_model
    result = run_single_agent(OpenAIBackend(url, "some-other-model", max_tokens=2, timeout=30), "x", max_steps=1)
    assert result.status == "error" and result.error.startswith("BackendError") and "HTTP 4" in result.error
    closed = OpenAIBackend(f"http://127.0.0.1:{_free_port()}/v1", "m", timeout=5)
    result = Swarm(closed).run("x")
    assert (
        result.status == "error" and "127.0.0.1" in result.error and result.trace.events[-1]["error"] == result.error
    )
    # as sub-agents, the same failures are tool errors for the orchestrator
    result = Swarm(ScriptedBackend(fan_out_orchestrator(2)), closed).run("x")
    assert result.status == "finished" and result.metrics["finish_rate"] == 0.0 and "BackendError" in result.answer
    with pytest.raises(ValueError, match="base_url"):
        OpenAIBackend("localhost:8000", "m")


def test_one_transformers_backend_serves_several_event_loops_at_once():
    """Parallel rollouts (one asyncio.run per thread) share a backend: each loop gets its own worker."""
    import threading

    model, tok = tiny_chat_model()
    backend = TransformersBackend(model, tok, max_new_tokens=3)
    results = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(run_single_agent(backend, f"task {i}", max_steps=1, timeout=120))
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 3 and all(r.status == "finished" for r in results)
