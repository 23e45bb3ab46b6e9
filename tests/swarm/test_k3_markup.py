"""The swarm on Kimi K3's chat markup (XTML): the orchestrator's create_subagent / assign_task calls round-trip
through K3's chat template and parser (transformers' parse_response with K3's response template, and the
parser used without a tokenizer), a scripted swarm speaking K3's markup runs end to end, and a backend on a K3
tokenizer stops at <|end_of_msg|>."""

import pytest

from kimi_hf.conversion.tokenizer import tiktoken_to_fast
from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import use_k3_chat_markup
from kimi_hf.swarm import (
    ORCHESTRATOR_TOOLS,
    ScriptedBackend,
    Swarm,
    TransformersBackend,
    format_tool_calls,
    parse_tool_calls,
)

from ..models.kimi_k3.release_format import write_k3_tokenizer_files
from .helpers import fan_out_orchestrator, lookup, worker


CALLS = [
    ("create_subagent", {"name": "scout", "system_prompt": 'Say "yes" & stop.'}),
    ("assign_task", {"agent": "scout", "task": "count the <b> tags"}),
]


@pytest.fixture(scope="module")
def k3_tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("k3_swarm_tok")
    write_k3_tokenizer_files(folder)
    return use_k3_chat_markup(tiktoken_to_fast(str(folder / "tiktoken.model"), str(folder / "tokenizer_config.json")))


def openai_calls(calls):
    return [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]


def test_orchestrator_calls_round_trip_through_the_k3_template_and_parser(k3_tok):
    messages = [{"role": "user", "content": "Plan the survey."}]
    prompt = k3_tok.apply_chat_template(messages, tools=ORCHESTRATOR_TOOLS, add_generation_prompt=True, tokenize=False)
    reply = {
        "role": "assistant",
        "reasoning_content": "two steps",
        "content": "On it.",
        "tool_calls": openai_calls(CALLS),
    }
    full = k3_tok.apply_chat_template(messages + [reply], tools=ORCHESTRATOR_TOOLS, tokenize=False)
    assert full.startswith(prompt)
    written = full[len(prompt) :]  # what the model writes after the generation prompt
    assert '<|open|>call tool="assign_task" index="2"<|sep|>' in written
    # the model's tokens, decoded as a backend decodes them, read back into the same calls
    decoded = k3_tok.decode(k3_tok(written, add_special_tokens=False)["input_ids"], skip_special_tokens=False)
    for tokenizer in (k3_tok, None):  # parse_response with K3's response template; the tokenizer-free parser
        content, calls = parse_tool_calls(decoded, tokenizer, prefix=prompt, tools=ORCHESTRATOR_TOOLS)
        assert content == "On it."
        assert [(c.name, c.arguments) for c in calls] == CALLS
        assert [c.id for c in calls] == ["functions.create_subagent:0", "functions.assign_task:1"]


def test_format_tool_calls_writes_what_the_template_renders(k3_tok):
    text = format_tool_calls(CALLS, "On it.", markup="k3")
    messages = [{"role": "user", "content": "Plan."}]
    prompt = k3_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    reply = {"role": "assistant", "reasoning_content": "", "content": "On it.", "tool_calls": openai_calls(CALLS)}
    assert prompt + text == k3_tok.apply_chat_template(messages + [reply], tokenize=False)
    assert text.endswith("<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>")
    content, calls = parse_tool_calls(text)
    assert content == "On it." and [(c.name, c.arguments) for c in calls] == CALLS
    with pytest.raises(ValueError, match="markup"):
        format_tool_calls(CALLS, markup="k9")


def test_malformed_k3_markup_is_content_not_a_crash():
    content, calls = parse_tool_calls(
        '<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="x"'
    )
    assert calls == [] and content.startswith("ok")


def test_a_swarm_speaking_k3_markup_runs_end_to_end():
    orchestrator = ScriptedBackend(fan_out_orchestrator(3, markup="k3"))
    sub = ScriptedBackend(worker(steps=2, markup="k3"))
    result = Swarm(orchestrator, sub, tools=[lookup], max_concurrency=3).run("collect three items")
    assert result.status == "finished"
    assert result.answer == " | ".join(f"done: item {i} turn 0" for i in range(3))
    m = result.metrics
    assert (m["num_subagents"], m["num_tasks"], m["finished_tasks"]) == (3, 3, 3)
    assert m["total_steps"] == 2 + 3 * 2


def test_a_backend_on_a_k3_tokenizer_stops_at_end_of_msg(k3_tok):
    backend = TransformersBackend(None, k3_tok)
    n = 256
    assert backend.stop_ids == [n + 2, n + 1]  # <|end_of_msg|>, then [EOS]
    assert backend.render([{"role": "user", "content": "hi"}]).endswith(
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
