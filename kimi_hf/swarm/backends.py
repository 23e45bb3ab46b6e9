"""Where the agents' completions come from: a transformers model (requests from concurrently running
agents are batched into one generate call), an OpenAI-compatible HTTP endpoint, or a script (tests,
examples). Every backend is `await backend.complete(messages, tools) -> Completion`."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..chat import chat_stop_token_ids
from .tools import ToolCall, parse_tool_calls


class BackendError(RuntimeError):
    """A backend could not produce a completion (HTTP error, malformed reply, ...)."""


@dataclass
class Completion:
    """One model turn: `content` without tool-call markup, the parsed calls, token counts, raw text."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    raw: str = ""

    @classmethod
    def from_text(cls, text: str, prompt_tokens: int = 0) -> "Completion":
        """A completion from text with tool-call markup (no tokenizer: completion_tokens counts words)."""
        content, calls = parse_tool_calls(text)
        return cls(content, calls, prompt_tokens, len(text.split()), text)

    def to_message(self) -> dict:
        message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.to_message() for c in self.tool_calls]
        return message


class Backend:
    async def complete(self, messages: list[dict], tools: list[dict] | None = None) -> Completion:
        raise NotImplementedError


class ScriptedBackend(Backend):
    """Completions from `policy(messages, tools)` (sync or async; returns text with tool-call markup, a
    Completion, or raises to simulate a failure), or from a list consumed in order. `latency` seconds
    are awaited per call (a stand-in for model time). Tracks the most calls ever in flight at once."""

    def __init__(self, policy: Callable | Iterable, latency: float = 0.0):
        if latency < 0:
            raise ValueError(f"latency must be >= 0, got {latency}")
        self._takes_args = callable(policy)
        if not self._takes_args:
            responses = iter(list(policy))

            def policy():
                try:
                    return next(responses)
                except StopIteration:
                    raise BackendError("the scripted responses are used up") from None

        self._policy = policy
        self.latency = latency
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def complete(self, messages, tools=None) -> Completion:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency:
                await asyncio.sleep(self.latency)
            out = self._policy(messages, tools) if self._takes_args else self._policy()
            if inspect.isawaitable(out):
                out = await out
        finally:
            self.in_flight -= 1
        if isinstance(out, Completion):
            return out
        if not isinstance(out, str):
            raise BackendError(f"a scripted policy must return a str or Completion, got {type(out).__name__}")
        return Completion.from_text(out, prompt_tokens=sum(len(str(m.get("content") or "").split()) for m in messages))


class TransformersBackend(Backend):
    """A transformers causal LM + tokenizer with a chat template. Requests that arrive while the model
    is busy (or within `batch_window` seconds of each other) are generated together, left-padded, in
    one `generate` call on a worker thread, at most `max_batch_size` at a time. Greedy by default;
    `generation_kwargs` go to generate (e.g. do_sample=True, temperature=0.7)."""

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens: int = 256,
        max_batch_size: int = 8,
        batch_window: float = 0.005,
        **generation_kwargs,
    ):
        if tokenizer.chat_template is None:
            raise ValueError("tokenizer has no chat_template: the backend renders messages and tools with it")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.max_batch_size, self.batch_window = max_new_tokens, max_batch_size, batch_window
        self.generation_kwargs = generation_kwargs
        self.stop_ids = chat_stop_token_ids(tokenizer)  # the chat turn's end stops too
        self.batch_sizes: list[int] = []  # one entry per generate call
        self._queues: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> (queue, worker)
        self._lock = threading.Lock()  # one generate at a time, whichever event loop asks

    def render(self, messages, tools=None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )

    async def complete(self, messages, tools=None) -> Completion:
        loop = asyncio.get_running_loop()
        queue, worker = self._queues.get(loop, (None, None))
        if worker is None or worker.done():  # one worker per event loop, restarted if it ever died
            queue = queue or asyncio.Queue()
            worker = loop.create_task(self._serve(queue))
            self._queues[loop] = (queue, worker)
        prompt = self.render(messages, tools)
        future = loop.create_future()
        await queue.put((prompt, tools, future))
        return await future

    async def _serve(self, queue: asyncio.Queue):
        while True:
            batch = [await queue.get()]
            if self.batch_window:
                await asyncio.sleep(self.batch_window)
            while len(batch) < self.max_batch_size and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                results = await asyncio.to_thread(self._generate, [p for p, _, _ in batch])
            except Exception as exc:  # every waiting agent sees the failure as its own
                results = [BackendError(f"generate failed: {exc!r}")] * len(batch)
            for (prompt, tools, fut), result in zip(batch, results):
                if fut.done():
                    continue
                try:
                    if isinstance(result, Exception):
                        raise result
                    text, n_prompt, n_new = result
                    content, calls = parse_tool_calls(text, self.tokenizer, prefix=prompt, tools=tools)
                    fut.set_result(Completion(content, calls, n_prompt, n_new, text))
                except Exception as exc:  # a future is always resolved: no agent waits forever
                    fut.set_exception(exc if isinstance(exc, BackendError) else BackendError(repr(exc)))

    def _generate(self, prompts: list[str]) -> list[tuple[str, int, int]]:
        tok = self.tokenizer
        with self._lock, torch.no_grad():
            enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            enc = {k: v.to(self.model.device) for k, v in enc.items()}
            self.batch_sizes.append(len(prompts))
            kwargs = {
                "max_new_tokens": self.max_new_tokens,
                "do_sample": False,
                "eos_token_id": self.stop_ids,
                "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else self.stop_ids[0],
            }
            out = self.model.generate(**enc, **{**kwargs, **self.generation_kwargs})
        width = enc["input_ids"].shape[1]
        results = []
        for row, mask in zip(out[:, width:].tolist(), enc["attention_mask"].sum(-1).tolist()):
            ends = [i for i, t in enumerate(row) if t in self.stop_ids]
            new = row[: ends[0]] if ends else row
            results.append((tok.decode(new, skip_special_tokens=False), mask, len(new) + bool(ends)))
        return results


class OpenAIBackend(Backend):
    """An OpenAI-compatible /v1/chat/completions endpoint (vLLM, SGLang, `transformers serve`, ...).
    At most `max_connections` requests in flight; each has `timeout` seconds. Tool calls come from the
    reply's `tool_calls`, or from the content's markup when the server does not parse them."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        timeout: float = 60.0,
        max_connections: int = 8,
        **extra_body,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key
        self.max_tokens, self.temperature, self.timeout = max_tokens, temperature, timeout
        self.max_connections, self.extra_body = max_connections, extra_body
        self.requests = 0
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> semaphore

    @staticmethod
    def _wire_message(m: dict) -> dict:
        """Tool-call arguments travel as JSON strings in the OpenAI format."""
        if m.get("tool_calls"):
            m = {
                **m,
                "tool_calls": [
                    {
                        **c,
                        "function": {
                            **c["function"],
                            "arguments": c["function"]["arguments"]
                            if isinstance(c["function"]["arguments"], str)
                            else json.dumps(c["function"]["arguments"]),
                        },
                    }
                    for c in m["tool_calls"]
                ],
            }
        return m

    def _post(self, payload: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(payload).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise BackendError(f"{self.url} answered HTTP {e.code}: {e.read()[:300]!r}") from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise BackendError(f"{self.url}: {e}") from e
        except json.JSONDecodeError as e:
            raise BackendError(f"{self.url}: the reply is not JSON: {e}") from e

    async def complete(self, messages, tools=None) -> Completion:
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.setdefault(loop, asyncio.Semaphore(self.max_connections))
        payload = {
            "model": self.model,
            "messages": [self._wire_message(m) for m in messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": False,
            **self.extra_body,
        }
        if tools:
            payload["tools"] = tools
        async with semaphore:
            self.requests += 1
            reply = await asyncio.to_thread(self._post, payload)
        try:
            message = reply["choices"][0]["message"]
        except (KeyError, IndexError, TypeError) as e:
            raise BackendError(f"{self.url}: no choices[0].message in the reply: {str(reply)[:300]}") from e
        text = message.get("content") or ""
        calls = []
        try:
            for i, c in enumerate(message.get("tool_calls") or []):
                args = c["function"].get("arguments") or "{}"
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass  # the raw string goes back to the agent as an error
                calls.append(ToolCall(c["function"]["name"], args, c.get("id") or f"call_{i}"))
        except (KeyError, TypeError, AttributeError) as e:
            raise BackendError(f"{self.url}: malformed tool_calls in the reply: {str(message)[:300]}") from e
        content = text
        if not calls:
            content, calls = parse_tool_calls(text)
        usage = reply.get("usage") or {}
        return Completion(
            content.strip(), calls, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), text
        )


__all__ = ["Backend", "BackendError", "Completion", "ScriptedBackend", "TransformersBackend", "OpenAIBackend"]
