"""The user's fine-tuning data (kimi_hf.finetune.data): TRL's formats from every kind of source, K3's chat template
with the loss on exactly what the model writes, and one-line errors naming the file, the row and the field."""

import json

import datasets
import pytest
import torch

from kimi_hf.collators import IGNORE_INDEX
from kimi_hf.finetune.data import SFTDataError, load_sft_rows, split_sft_rows, tokenize_sft_rows
from kimi_hf.models.kimi_k3.chat_template_kimi_k3 import render_k3_reply
from kimi_hf.tokenization import train_tokenizer


CORPUS = ["hello world, the weather in Paris is 18C.", "What is 15% of 240? It is 36.", "get_weather city"] * 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
    },
]
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Paris", "reasoning_content": "hell"},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
    {"role": "tool", "content": "18C"},
    {"role": "assistant", "content": "18C."},
]
WEATHER_CALL_DICT = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ROWS = [  # tools; calls of different tools in two rows; a row with no tools (Arrow fills the others' keys with null)
    {"messages": CHAT[:4] + [{**CHAT[4], "tool_calls": [WEATHER_CALL_DICT]}] + CHAT[5:], "tools": TOOLS},
    {
        "messages": [
            {"role": "user", "content": "find x"},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}],
            },
        ],
        "tools": TOOLS[1:],
    },
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
]
# the same rows with `tools` and the call's arguments as JSON strings
AS_STRINGS = [
    {**ROWS[0], "messages": CHAT, "tools": json.dumps(TOOLS)},
    {**ROWS[1], "tools": json.dumps(TOOLS[1:])},
    ROWS[2],
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=300, markup="k3")


def runs(labels: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of trained labels."""
    on = (labels != IGNORE_INDEX).tolist() + [False]
    out, start = [], None
    for t, x in enumerate(on):
        if x and start is None:
            start = t
        elif not x and start is not None:
            out.append((start, t))
            start = None
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_source_gives_the_same_documents(tok, tmp_path):
    """.jsonl, .json, .parquet, save_to_disk, a Dataset, a list of rows, `tools` and arguments as JSON strings: the same
    tokens and labels. Arrow's unified structs (parquet / save_to_disk / from_list fill other rows' keys with null:
    `tool_calls: None` on user messages, `arguments: {"city": None, ...}`) are dropped before rendering."""
    arrow = datasets.Dataset.from_list(ROWS)
    assert arrow[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": None, "query": "x"}
    write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    arrow.to_parquet(str(tmp_path / "d.parquet"))
    arrow.save_to_disk(str(tmp_path / "disk"))
    write_jsonl(tmp_path / "strings.jsonl", AS_STRINGS)
    sources = ["d.jsonl", "d.json", "d.parquet", "disk", "strings.jsonl"]
    sources = [str(tmp_path / s) for s in sources] + [arrow, ROWS, AS_STRINGS]
    ref = tokenize_sft_rows(load_sft_rows(sources[0]), tok)
    assert len(ref) == 3 and ref.skipped == 0 and ref.rows.tolist() == [0, 1, 2]
    for source in sources[1:]:
        data = load_sft_rows(source)
        assert data.format == "messages" and len(data) == 3
        docs = tokenize_sft_rows(data, tok)
        assert torch.equal(docs.input_ids, ref.input_ids) and torch.equal(docs.labels, ref.labels), source
        assert torch.equal(docs.offsets, ref.offsets)
    text = tok.decode(ref.input_ids[: ref.offsets[1]])
    assert '"required":["city"]' in text and "null" not in text  # the tool declaration, as given


@pytest.mark.parametrize("thinking", [True, False])
def test_loss_is_on_exactly_the_assistant_replies(tok, thinking):
    """The trained tokens are, run by run, the text K3 writes for each assistant message (render_k3_reply: after
    the generation prompt, through <|end_of_msg|>), the tool call included; the tool result, user and system
    text are context only."""
    data = load_sft_rows([{"messages": CHAT, "tools": json.dumps(TOOLS)}])
    docs = tokenize_sft_rows(data, tok, chat_template_kwargs={"enable_thinking": thinking, "thinking_effort": None})
    ids, labels = docs.input_ids, docs.labels
    assert torch.equal(labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])
    replies = [tok.decode(ids[a:b]) for a, b in runs(labels)]
    assert replies == [
        render_k3_reply("Paris", reasoning_content="hell", thinking=thinking),
        render_k3_reply("", tool_calls=[WEATHER_CALL], thinking=thinking),
        render_k3_reply("18C.", thinking=thinking),
    ]
    assert 'argument key="city" type="string"<|sep|>Paris' in replies[1]  # the JSON-string arguments parsed
    assert tok.decode(ids[runs(labels)[1][1] :]).startswith('<|open|>message role="tool" tool="get_weather"')
    assert labels[0] == IGNORE_INDEX


def test_kimi_linear_markup():
    """Kimi Linear's template (Kimi K2's markup) has generation markers too: the replies through <|im_end|>."""
    from kimi_hf.models.kimi_hybrid.chat_markup_kimi_hybrid import render_kimi_reply

    kimi = train_tokenizer(CORPUS, vocab_size=300, markup="kimi")
    docs = tokenize_sft_rows(load_sft_rows([{"messages": CHAT, "tools": TOOLS}]), kimi)
    replies = [kimi.decode(docs.input_ids[a:b]) for a, b in runs(docs.labels)]
    assert replies == [render_kimi_reply("Paris"), render_kimi_reply("", [WEATHER_CALL]), render_kimi_reply("18C.")]


def test_row_chat_template_kwargs_and_the_default_preamble(tok):
    """Without options K3's template writes its thinking-effort preamble (K3's default "max"); a row's own
    chat_template_kwargs (TRL's column) override the call's."""
    chat = CHAT[1:3]
    plain = tokenize_sft_rows(load_sft_rows([{"messages": chat}]), tok)
    quiet = tokenize_sft_rows(
        load_sft_rows([{"messages": chat, "chat_template_kwargs": {"thinking_effort": None}}]), tok
    )
    assert "thinking_effort=max" in tok.decode(plain.input_ids)
    assert "thinking_effort" not in tok.decode(quiet.input_ids)
    over = tokenize_sft_rows(
        load_sft_rows([{"messages": chat, "chat_template_kwargs": {"thinking_effort": None}}]),
        tok,
        chat_template_kwargs={"thinking_effort": "low"},
    )
    assert torch.equal(over.input_ids, quiet.input_ids)
    assert tok.decode(quiet.labels[quiet.labels != IGNORE_INDEX]) == render_k3_reply("Paris", reasoning_content="hell")


def test_prompt_completion_and_text(tok):
    """prompt / completion as messages: the completion's reply; as strings: the completion and the EOS appended;
    text: every token but the first, EOS appended."""
    options = {"thinking_effort": None}
    conv = tokenize_sft_rows(
        load_sft_rows([{"prompt": CHAT[:2], "completion": CHAT[2:3]}]), tok, chat_template_kwargs=options
    )
    assert [tok.decode(conv.input_ids[a:b]) for a, b in runs(conv.labels)] == [
        render_k3_reply("Paris", reasoning_content="hell")
    ]
    # a completion with a call, its result and the answer: the result is not trained on
    tools = tokenize_sft_rows(
        load_sft_rows([{"prompt": CHAT[:4], "completion": CHAT[4:], "tools": TOOLS}]),
        tok,
        chat_template_kwargs=options,
    )
    got = [tok.decode(tools.input_ids[a:b]) for a, b in runs(tools.labels)]
    assert got == [render_k3_reply("", tool_calls=[WEATHER_CALL]), render_k3_reply("18C.")]

    data = load_sft_rows([{"prompt": "What is 15% of 240?", "completion": " It is 36."}])
    assert data.format == "prompt-completion"
    docs = tokenize_sft_rows(data, tok)
    trained = docs.labels[docs.labels != IGNORE_INDEX]
    assert tok.decode(trained) == " It is 36." + tok.eos_token

    docs = tokenize_sft_rows(load_sft_rows([{"text": "hello world"}, {"text": tok.eos_token}]), tok)
    assert len(docs) == 1 and docs.skipped == 1  # the one-token row has nothing to predict
    assert tok.decode(docs.input_ids) == "hello world" + tok.eos_token
    assert docs.labels[0] == IGNORE_INDEX and torch.equal(docs.labels[1:], docs.input_ids[1:])


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
BAD_ROWS = [  # (the second row, the error's text after "data.jsonl: row 1: ")
    ({"messages": "hi"}, "messages: must be a non-empty list of {role, content} messages"),
    ({"messages": [{"role": "user", "content": "hi"}, "yo"]}, "messages[1]: must be a {role, content} dict, got str"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role: unknown role 'bot'"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role: unknown role None"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content: is missing"),
    ({"messages": [{"role": "assistant", "content": 3}]}, "messages[0].content: must be a string or a list of parts"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages: has no assistant message"),
    ({**GOOD, "tools": "[{not json"}, "tools: is not valid JSON"),
    ({**GOOD, "tools": {"name": "f"}}, "tools: must be a list of tool schemas"),
    (
        {
            "messages": [
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}
            ]
        },
        "messages[0].tool_calls[0].function.arguments: is not valid JSON",
    ),
    (
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": {}}}]}]},
        "messages[0].tool_calls[0].function.name: must be a non-empty string",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image"}]}, GOOD["messages"][1]], "images": ["a", "b"]},
        "images: 2 images for 1 image parts",
    ),
    ({**GOOD, "images": "a.png"}, "images: must be a list of images, got str"),
]


@pytest.mark.parametrize("row, problem", BAD_ROWS, ids=[p.split(":")[0] for _, p in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_file_row_and_field(tmp_path, row, problem):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, row])
    with pytest.raises(SFTDataError) as e:
        load_sft_rows(path, name="data.jsonl")
    assert str(e.value).startswith("data.jsonl: row 1: " + problem) and "\n" not in str(e.value)
    assert e.value.row == 1 and isinstance(e.value, ValueError)


def test_bad_sources(tmp_path):
    cases = {
        "missing.jsonl": (None, "no such file or folder"),
        "data.csv": ("text\nhi\n", "unknown extension '.csv'"),
        "empty.jsonl": ("", "the dataset is empty"),
        "empty.json": ("[]", "the dataset is empty"),
        "broken.jsonl": ('{"text": "a"}\n{"text": \n', "cannot read it as jsonl"),
        "other.jsonl": ('{"question": "a"}\n', "no recognised column"),
        "half.jsonl": ('{"prompt": "a"}\n', "has a prompt column but no 'completion' column"),
        "mixed.jsonl": ('{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}\n', "row 0: prompt:"),
        "blank.jsonl": ('{"text": ""}\n', "row 0: text: must be a non-empty string"),
    }
    for name, (content, problem) in cases.items():
        if content is not None:
            (tmp_path / name).write_text(content)
        with pytest.raises(SFTDataError, match="^" + name + ": .*") as e:
            load_sft_rows(str(tmp_path / name), name=name)
        assert problem in str(e.value) and "\n" not in str(e.value), name


def test_rows_the_template_or_the_packer_refuse_name_the_row(tok):
    """Checked at tokenization: a K3 tool result with no nameable tool (the template raises), images."""
    orphan = {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "18C"}, CHAT[2]]}
    with pytest.raises(SFTDataError, match=r"^rows: row 1: messages: the chat template failed: .*tool name"):
        tokenize_sft_rows(load_sft_rows([GOOD, orphan]), tok)
    image = {"messages": [{"role": "user", "content": [{"type": "image"}]}, CHAT[2]], "images": ["cat.png"]}
    with pytest.raises(SFTDataError, match=r"^rows: row 0: images: packed fine-tuning is text-only"):
        tokenize_sft_rows(load_sft_rows([image]), tok)


def test_eval_split_is_deterministic_and_keeps_row_numbers(tok):
    data = load_sft_rows([{"text": f"row {i}"} for i in range(20)])
    train, held = split_sft_rows(data, 0.25, seed=3)
    again = split_sft_rows(data, 0.25, seed=3)
    assert len(held) == 5 and len(train) == 15
    assert held.row_numbers == again[1].row_numbers and train.row_numbers == again[0].row_numbers
    assert sorted(train.row_numbers + held.row_numbers) == list(range(20))
    assert [r["text"] for r in held.rows] == [f"row {i}" for i in held.row_numbers]
    assert split_sft_rows(data, 0.25, seed=4)[1].row_numbers != held.row_numbers
    assert tokenize_sft_rows(held, tok).rows.tolist() == list(held.row_numbers)
    with pytest.raises(SFTDataError, match="cannot spare"):
        split_sft_rows(load_sft_rows([{"text": "a"}]), 0.5)
