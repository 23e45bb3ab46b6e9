"""The user's fine-tuning data in TRL's dataset formats, validated, then tokenized with the model's chat template.

Two passes, so that a command line can reject a bad flag, file or row before any model is built:

    data = load_sft_rows("chats.jsonl")                 # reads and checks every row (no tokenizer): SFTDataError
    docs = tokenize_sft_rows(data, tokenizer)           # one document per row, labels on what the model learns

Sources: a `.jsonl` / `.json` / `.parquet` file or a `Dataset.save_to_disk` folder (read by `datasets`, locally), a
`datasets.Dataset`, or a list of row dicts. The format is the first of these columns found:

- `messages` (conversational): a list of {"role", "content"} with roles system / user / assistant / tool; content a
  string or a list of parts ({"type": "text", "text"} / {"type": "image"}); an assistant message may carry
  `tool_calls` (OpenAI-style, `arguments` a dict or a JSON-object string; its content may then be null) and
  `reasoning_content`. Optional `tools` (a list of tool schemas, or that list as a JSON string), `images` and
  `chat_template_kwargs` (a dict for this row's template, as TRL reads it). Loss: the assistant's replies only,
  the chat template's `{% generation %}` spans (`return_assistant_tokens_mask`, TRL's `assistant_only_loss`):
  for K3, what the model writes after the generation prompt, through `<|end_of_msg|>`; tool results, user and
  system text are context.
- `prompt` + `completion`: both strings, or both message lists. Strings: loss on the completion's tokens (and
  the EOS appended to it); messages: loss on the completion's assistant replies (the tokens after where the
  prompt rendered with the generation prompt and prompt + completion diverge, TRL's rule, that are also in a
  generation span: a tool result inside a completion is not trained on).
- `text`: loss on every token, EOS appended (TRL's language modelling).

Labels are transformers' (unshifted: the loss shifts them, so labels[t] is predicted from token t - 1), with
IGNORE_INDEX on tokens not trained on and on each document's first token (nothing in the document predicts it).

Arrow (parquet, save_to_disk, `Dataset.from_list`) stores a column's structs with the union of the rows' keys, the
missing ones as null: null values are dropped from messages, tool calls, their arguments and tool schemas before
use (so a tool-call argument whose value is null is dropped too: give such arguments as a JSON string). Not from
`chat_template_kwargs`, where null is a value (K3's `thinking_effort=None`): in an Arrow-typed source give every row
the same keys. (`.json` / `.jsonl` files keep each row as written: `datasets` reads mixed structures as Json.)

Images: the `images` column is checked (a list, as many as the messages' image parts) but not tokenized here: packed
fine-tuning is text-only; rows with images are refused at tokenization (TRL's SFTTrainer trains them unpacked with
K3's processor: examples/k3_sft_trl.py; kimi_hf.collators.KimiHybridVisionCollator batches them for transformers'
Trainer).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..cli_args import one_line
from ..collators import IGNORE_INDEX
from ..models.kimi_k3.chat_template_kimi_k3 import has_k3_markup, normalize_k3_messages


FILE_EXTENSIONS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # -> the `datasets` builder
ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("messages", "prompt-completion", "text")


class SFTDataError(ValueError):
    """A bad data source or row. str(e) is one line: `SOURCE: row I: FIELD: problem` (row and field when known;
    rows count from 0 in the source's order)."""

    def __init__(self, source: str, problem: str, row: int | None = None, field: str | None = None):
        self.source, self.problem, self.row, self.field = source, problem, row, field
        where = source + ("" if row is None else f": row {row}") + ("" if not field else f": {field}")
        super().__init__(f"{where}: {problem}")


class _Bad(Exception):
    """A row's problem, raised by the checks below and turned into SFTDataError with the source and row."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class SFTData:
    """Validated rows of one source. rows: the `datasets.Dataset`; format: one of FORMATS; source: its name in
    errors; row_numbers: each row's index in the source (None: 0 .. len - 1; a split keeps the source's)."""

    rows: object
    format: str
    source: str
    row_numbers: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def row_number(self, i: int) -> int:
        return i if self.row_numbers is None else self.row_numbers[i]


@dataclass(frozen=True)
class Documents:
    """Tokenized documents, concatenated: document d is input_ids[offsets[d] : offsets[d + 1]].

    input_ids [N] int64; labels [N] int64 (the token, or IGNORE_INDEX where not trained on; each document's first
    token is IGNORE_INDEX); offsets [D + 1] int64; rows [D] int64: the source row of each document (rows without a
    trained token are left out: `skipped` counts them)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    rows: torch.Tensor
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> torch.Tensor:
        """[D] int64: the documents' token counts."""
        return self.offsets[1:] - self.offsets[:-1]


# ---- reading ----


def _read(source, name: str):
    """(datasets.Dataset, its name in errors) for a path, a Dataset or a list of row dicts."""
    import datasets

    if isinstance(source, datasets.Dataset):
        return source, name or "dataset"
    if isinstance(source, datasets.DatasetDict):
        raise SFTDataError(name or "dataset", f"a DatasetDict (splits {sorted(source)}): pass one split")
    if isinstance(source, list):
        if not all(isinstance(r, dict) for r in source):
            raise SFTDataError(name or "rows", "a list of rows must hold dicts")
        try:
            try:  # datasets >= 5: a column of mixed structures (a string here, a list there) as Json
                return datasets.Dataset.from_list(source, on_mixed_types="use_json"), name or "rows"
            except TypeError:  # older datasets: no such option
                return datasets.Dataset.from_list(source), name or "rows"
        except Exception as e:  # pyarrow cannot give a column one type (a string here, a list there)
            raise SFTDataError(name or "rows", f"cannot make a dataset of the rows: {one_line(e)}") from None
    if not isinstance(source, (str, os.PathLike)):
        raise SFTDataError(name or repr(source), "expected a file, a folder, a datasets.Dataset or a list of rows")
    path = os.fspath(source)
    name = name or path
    if not os.path.exists(path):
        raise SFTDataError(name, "no such file or folder")
    # quiet while reading: "Generating train split" bars and the json builder's own error log are noise on a
    # command line that reports one line
    bars, logger = datasets.is_progress_bar_enabled(), logging.getLogger("datasets")
    level = logger.level
    datasets.disable_progress_bars()
    logger.setLevel(logging.CRITICAL)
    try:
        return _read_path(path, name, datasets), name
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def _read_path(path: str, name: str, datasets):
    if os.path.isdir(path):
        try:
            ds = datasets.load_from_disk(path)
        except (FileNotFoundError, ValueError) as e:
            raise SFTDataError(name, f"not a folder written by Dataset.save_to_disk ({one_line(e)})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds and len(ds) != 1:
                raise SFTDataError(name, f"a DatasetDict folder with splits {sorted(ds)} and no 'train'")
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return ds
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_EXTENSIONS:
        raise SFTDataError(
            name, f"unknown extension {ext or '(none)'!r}: expected .jsonl, .json, .parquet or a save_to_disk folder"
        )
    if os.path.getsize(path) == 0:
        raise SFTDataError(name, "the dataset is empty")
    try:
        return datasets.load_dataset(FILE_EXTENSIONS[ext], data_files=os.path.abspath(path), split="train")
    except Exception as e:  # pyarrow's parse errors, wrapped in DatasetGenerationError; bad parquet bytes
        cause = e.__cause__ or e
        if "corresponds to no data" in str(cause):  # a JSON file holding []
            raise SFTDataError(name, "the dataset is empty") from None
        raise SFTDataError(name, f"cannot read it as {ext[1:]}: {one_line(cause)}") from None


def _format_of(columns: list[str], name: str) -> str:
    if "messages" in columns:
        return "messages"
    if "prompt" in columns or "completion" in columns:
        if not ("prompt" in columns and "completion" in columns):
            missing = "completion" if "prompt" in columns else "prompt"
            raise SFTDataError(
                name, f"has a {'prompt' if missing == 'completion' else 'completion'} column but no {missing!r} column"
            )
        return "prompt-completion"
    if "text" in columns:
        return "text"
    raise SFTDataError(
        name, f"no recognised column (columns: {columns}): expected 'messages', 'prompt' + 'completion' or 'text'"
    )


def load_sft_rows(source, *, name: str | None = None) -> SFTData:
    """Reads `source` (a path, a datasets.Dataset or a list of row dicts) and checks every row (no tokenizer, no
    model): SFTDataError (a ValueError) naming the source, the row and the field for a missing file, an unknown
    extension, an unreadable file, no recognised column, an empty dataset or a bad row. name: the source's name
    in errors (default: the path as given)."""
    ds, name = _read(source, name)
    fmt = _format_of(list(ds.column_names), name)
    if len(ds) == 0:
        raise SFTDataError(name, "the dataset is empty")
    data = SFTData(ds, fmt, name)
    for i, row in enumerate(ds):
        _parse(data, i, row)
    return data


def split_sft_rows(data: SFTData, eval_fraction: float, seed: int = 0) -> tuple[SFTData, SFTData]:
    """(train, eval): a deterministic random eval_fraction of the rows (at least one; a pure function of the rows'
    count and seed) held out. Both keep the source's row numbers in their errors."""
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be between 0 and 1, got {eval_fraction}")
    n = len(data)
    n_eval = max(1, round(n * eval_fraction))
    if n_eval >= n:
        raise SFTDataError(data.source, f"{n} rows cannot spare {eval_fraction:g} of them for evaluation")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    parts = (sorted(order[n_eval:]), sorted(order[:n_eval]))  # source order inside each part
    return tuple(
        SFTData(data.rows.select(idx), data.format, data.source, tuple(data.row_number(i) for i in idx))
        for idx in parts
    )


# ---- checking a row (and what rendering reads) ----


def _drop_nulls(value, depth: int):
    """Dicts without their null values, `depth` levels of dicts down (Arrow's unified structs: see the module)."""
    if depth == 0 or not isinstance(value, dict):
        return value
    return {k: _drop_nulls(v, depth - 1) for k, v in value.items() if v is not None}


def _drop_nulls_deep(value):
    if isinstance(value, dict):
        return {k: _drop_nulls_deep(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls_deep(v) for v in value]
    return value


def _check_content(content, field: str, optional: bool) -> tuple[object, int]:
    """(content with nulls dropped from its parts, its number of image parts); _Bad if it is not a string or a
    list of parts."""
    if content is None:
        if optional:
            return None, 0
        raise _Bad(field, "is missing (a message needs 'content': a string or a list of parts)")
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        raise _Bad(field, f"must be a string or a list of parts, got {type(content).__name__}")
    parts, images = [], 0
    for j, part in enumerate(content):
        if not isinstance(part, str):
            part = _drop_nulls(part, 1)
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise _Bad(f"{field}[{j}]", 'must be a string or a dict with a "type"')
            if part["type"] in ("image", "image_url"):
                images += 1
            elif not isinstance(part.get("text"), str):
                raise _Bad(f"{field}[{j}]", f'a {part["type"]!r} part needs a string "text"')
        parts.append(part)
    return parts, images


def _check_tool_calls(calls, field: str) -> list[dict]:
    if not isinstance(calls, list):
        raise _Bad(field, f"must be a list of calls, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        f = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise _Bad(f, "must be a dict")
        call = _drop_nulls(call, 1)
        fn = call.get("function", call)
        if not isinstance(fn, dict):
            raise _Bad(f + ".function", "must be a dict with 'name' and 'arguments'")
        fn = _drop_nulls(fn, 2)  # the function dict and its arguments
        where = f + (".function" if "function" in call else "")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _Bad(where + ".name", "must be a non-empty string")
        arguments = fn.get("arguments")
        if isinstance(arguments, str) and arguments.strip():
            try:
                parsed = json.loads(arguments)
            except ValueError as e:
                raise _Bad(where + ".arguments", f"is not valid JSON ({e})") from None
            if not isinstance(parsed, dict):
                raise _Bad(where + ".arguments", "must be a JSON object")
        elif arguments is not None and not isinstance(arguments, (dict, str)):
            raise _Bad(where + ".arguments", "must be a dict or a JSON-object string")
        out.append({**call, "function": fn} if "function" in call else fn)
    return out


def _check_messages(messages, field: str, need_assistant: bool) -> tuple[list[dict], int]:
    """(messages with nulls dropped, their image parts); _Bad naming the message and field."""
    if not isinstance(messages, list) or not messages:
        raise _Bad(field, "must be a non-empty list of {role, content} messages")
    out, images = [], 0
    for j, message in enumerate(messages):
        f = f"{field}[{j}]"
        if not isinstance(message, dict):
            raise _Bad(f, f"must be a {{role, content}} dict, got {type(message).__name__}")
        message = _drop_nulls(message, 1)  # a new dict: the row is not changed
        role = message.get("role")
        if role not in ROLES:
            raise _Bad(f + ".role", f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise _Bad(f + ".tool_calls", f"only assistant messages make tool calls, this one is {role!r}")
            message = {**message, "tool_calls": _check_tool_calls(calls, f + ".tool_calls")}
        content, n = _check_content(message.get("content"), f + ".content", optional=bool(calls))
        if "content" in message:
            message["content"] = content
        images += n
        for key in ("reasoning_content", "name", "tool_call_id"):
            if key in message and not isinstance(message[key], str):
                raise _Bad(f"{f}.{key}", f"must be a string, got {type(message[key]).__name__}")
        out.append(message)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise _Bad(field, "has no assistant message: nothing to train on")
    return out, images


def _check_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            raise _Bad("tools", f"is not valid JSON ({e})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _Bad("tools", "must be a list of tool schemas (dicts), or that list as a JSON string")
    return [_drop_nulls_deep(t) for t in tools] or None


def _check_images(images, image_parts: int) -> int:
    """The number of images; _Bad when not a list or not one per image part."""
    if images is None:
        images = []
    if not isinstance(images, (list, tuple)):
        raise _Bad("images", f"must be a list of images, got {type(images).__name__}")
    if image_parts and len(images) != image_parts:
        raise _Bad("images", f"{len(images)} images for {image_parts} image parts in the messages")
    return max(len(images), image_parts)


def _parse(data: SFTData, i: int, row: dict) -> dict:
    """Row i as rendering reads it: {"messages" | "prompt", "completion" | "text", "tools", "kwargs", "images"};
    SFTDataError for a bad row."""
    try:
        return _parse_row(data.format, row)
    except _Bad as e:
        raise SFTDataError(data.source, e.problem, data.row_number(i), e.field) from None


def _parse_row(fmt: str, row: dict) -> dict:
    out = {"tools": None, "kwargs": {}, "images": 0}
    kwargs = row.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise _Bad("chat_template_kwargs", "must be a dict")
        out["kwargs"] = dict(kwargs)  # nulls kept: K3's thinking_effort=None is a value (see the module)
    if fmt == "text":
        if not isinstance(row["text"], str) or not row["text"]:
            raise _Bad("text", "must be a non-empty string")
        out["text"] = row["text"]
        return out
    out["tools"] = _check_tools(row.get("tools"))
    if fmt == "messages":
        out["messages"], parts = _check_messages(row["messages"], "messages", need_assistant=True)
    else:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion:
                raise _Bad("completion", "is empty: nothing to train on")
            out["prompt"], out["completion"] = prompt, completion
            return out
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise _Bad(
                "prompt",
                f"prompt and completion must both be strings or both message lists, got "
                f"{type(prompt).__name__} and {type(completion).__name__}",
            )
        out["prompt"], parts = _check_messages(prompt, "prompt", need_assistant=False)
        out["completion"], more = _check_messages(completion, "completion", need_assistant=True)
        parts += more
    out["images"] = _check_images(row.get("images"), parts)
    return out


# ---- tokenizing ----


def _template_ids(tokenizer, messages, parsed, options, **extra) -> tuple[list[int], list[int] | None]:
    """(input ids, assistant mask or None) of messages rendered by the tokenizer's chat template."""
    if has_k3_markup(tokenizer):
        messages = normalize_k3_messages(messages)  # JSON-string arguments parsed, as K3's encoder does
    kwargs = {**options, **parsed["kwargs"], **extra}  # the row's own options over the call's
    out = tokenizer.apply_chat_template(messages, tools=parsed["tools"], tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"]), out.get("assistant_masks")


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _document(parsed: dict, fmt: str, tokenizer, options: dict) -> tuple[list[int], list[bool]]:
    """(input ids, trained-on flags) of one parsed row."""
    if fmt == "text":
        ids = _with_eos(tokenizer(parsed["text"])["input_ids"], tokenizer)
        return ids, [True] * len(ids)
    if fmt == "messages":
        ids, mask = _template_ids(tokenizer, parsed["messages"], parsed, options, return_assistant_tokens_mask=True)
        if not any(mask or ()):
            raise _Bad("messages", "the chat template marks no assistant tokens: it needs {% generation %} markers")
        return ids, [bool(m) for m in mask]
    prompt, completion = parsed["prompt"], parsed["completion"]
    if isinstance(prompt, str):
        prompt_ids = tokenizer(prompt)["input_ids"]
        ids = _with_eos(tokenizer(prompt + completion)["input_ids"], tokenizer)
        start = _common_prefix(prompt_ids, ids)
        return ids, [t >= start for t in range(len(ids))]
    prompt_ids, _ = _template_ids(tokenizer, prompt, parsed, options, add_generation_prompt=True)
    ids, mask = _template_ids(tokenizer, prompt + completion, parsed, options, return_assistant_tokens_mask=True)
    start = _common_prefix(prompt_ids, ids)
    trained = [bool(m) and t >= start for t, m in enumerate(mask or ())]
    if not any(trained):
        raise _Bad("completion", "no token of the completion is in an assistant reply the chat template marks")
    return ids, trained


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Where `a` and `b` first differ: the completion's start (TRL's common_prefix_length)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_sft_rows(data: SFTData, tokenizer, *, chat_template_kwargs: dict | None = None) -> Documents:
    """One document per row of `data` (from load_sft_rows), rendered with `tokenizer`'s chat template (a processor's
    tokenizer is used); labels as the module says. chat_template_kwargs: for every rendering (e.g. K3's
    `thinking_effort=None`, `enable_thinking=False`), under each row's own `chat_template_kwargs`. Rows whose every
    label is IGNORE_INDEX (a one-token text) are left out and counted in `skipped`. SFTDataError for a row the
    template rejects (e.g. a K3 tool result whose tool cannot be named) or a row with images."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    options = dict(chat_template_kwargs or {})
    ids_parts, label_parts, lengths, rows, skipped = [], [], [0], [], 0
    for i, row in enumerate(data.rows):
        parsed = _parse(data, i, row)
        try:
            if parsed["images"]:
                raise _Bad(
                    "images",
                    "packed fine-tuning is text-only: train rows with images through TRL's SFTTrainer "
                    "(examples/k3_sft_trl.py, unpacked)",
                )
            ids, trained = _document(parsed, data.format, tokenizer, options)
        except _Bad as e:
            raise SFTDataError(data.source, e.problem, data.row_number(i), e.field) from None
        except Exception as e:  # the template's raise_exception (jinja2's TemplateError) and the like
            field = "messages" if data.format == "messages" else None
            raise SFTDataError(
                data.source, f"the chat template failed: {one_line(e)}", data.row_number(i), field
            ) from e
        ids = np.asarray(ids, dtype=np.int64)
        labels = np.where(trained, ids, IGNORE_INDEX)
        labels[0] = IGNORE_INDEX  # a document's first token: nothing in the document predicts it
        if (labels == IGNORE_INDEX).all():
            skipped += 1
            continue
        ids_parts.append(ids)
        label_parts.append(labels)
        lengths.append(len(ids))
        rows.append(data.row_number(i))
    if not rows:
        raise SFTDataError(data.source, "no row has a token to train on")
    return Documents(
        input_ids=torch.from_numpy(np.concatenate(ids_parts)),
        labels=torch.from_numpy(np.concatenate(label_parts)),
        offsets=torch.tensor(lengths, dtype=torch.int64).cumsum(0),
        rows=torch.tensor(rows, dtype=torch.int64),
        skipped=skipped,
    )


__all__ = [
    "Documents",
    "FORMATS",
    "FILE_EXTENSIONS",
    "ROLES",
    "SFTData",
    "SFTDataError",
    "load_sft_rows",
    "split_sft_rows",
    "tokenize_sft_rows",
]
