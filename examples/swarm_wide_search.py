"""Wide search over a local document collection: one serial agent vs an orchestrator with parallel
sub-agents, same agent policy and same per-agent step budget (Kimi K2.5's critical-steps comparison, arXiv 2602.02276).

Documents: the module docstrings of the Python standard library (offline). Task: "give the first
sentence of the documentation of each of these N modules"; tools: `search_docs(query)` and
`read_doc(module)`. Quality: the fraction of modules whose first sentence appears in the answer.

    python examples/swarm_wide_search.py                                   # scripted policy, 24 modules
    python examples/swarm_wide_search.py --backend openai --base-url http://127.0.0.1:8000/v1 --model NAME
    python examples/swarm_wide_search.py --backend transformers --model path/to/chat-model

No pretrained chat model ships offline, so the default agents are a *scripted policy* (read the
assigned documents one tool call per step, then answer; the orchestrator splits the list into chunks),
with `--step-latency` seconds per model call standing in for generation time. It measures what the
runtime adds: critical steps, wall time, and how a fixed step budget caps a serial agent. With
--backend openai / transformers the same comparison runs with a real model choosing the tool calls.
Speed-ups are printed, beside the answers' quality, only when both runs finished; a run that failed (a backend
error) makes the exit status 1. Traces (JSONL) are written to --out.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import sys
import urllib.error
import urllib.request
import warnings

from kimi_hf.cli_args import ArgumentParser, check_output_folder, check_positive
from kimi_hf.model_folder import check_model_folder
from kimi_hf.serving import served_model_types
from kimi_hf.swarm import (
    OpenAIBackend,
    ScriptedBackend,
    Swarm,
    TransformersBackend,
    format_tool_calls,
    run_single_agent,
)


MODULES = [
    "abc",
    "argparse",
    "ast",
    "base64",
    "bisect",
    "calendar",
    "colorsys",
    "contextlib",
    "copy",
    "csv",
    "difflib",
    "fnmatch",
    "fractions",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "json",
    "pickle",
    "pprint",
    "queue",
    "random",
    "shlex",
    "string",
    "tarfile",
    "textwrap",
    "timeit",
    "uuid",
    "zipfile",
    "statistics",
]


def load_docs(names) -> dict[str, str]:
    docs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            doc = (importlib.import_module(name).__doc__ or "").strip()
            if doc:
                docs[name] = doc
    return docs


def first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text)[:200]


def make_tools(docs):
    def search_docs(query: str) -> str:
        """Lists the modules whose documentation mentions the query.

        Args:
            query: words to look for (case-insensitive).
        """
        hits = [n for n, d in docs.items() if query.lower() in d.lower()]
        return ", ".join(hits[:20]) or "no match"

    def read_doc(module: str) -> str:
        """Returns the documentation of a module (the first 600 characters).

        Args:
            module: the module's name, e.g. "json".
        """
        if module not in docs:
            raise KeyError(f"no document named {module!r}")
        return docs[module][:600]

    return [search_docs, read_doc]


def task_text(names) -> str:
    return (
        "Give the first sentence of the documentation of each of these modules, one per line as "
        "'module: sentence': " + ", ".join(names)
    )


def listed_modules(text: str) -> list[str]:
    return [m.strip() for m in text.rsplit(":", 1)[-1].split(",") if m.strip()]


def reader_policy(messages, tools):
    """Scripted agent: read every listed module (one read_doc per step), then answer."""
    wanted = listed_modules(messages[1]["content"])
    read = {}
    for m in messages:
        if m["role"] == "assistant":
            for c in m.get("tool_calls") or []:
                read[c["id"]] = c["function"]["arguments"].get("module")
    results = {read.get(m["tool_call_id"]): m["content"] for m in messages if m["role"] == "tool"}
    todo = [w for w in wanted if w not in results]
    if todo:
        return format_tool_calls([("read_doc", {"module": todo[0]})])
    return "\n".join(f"{w}: {first_sentence(results[w])}" for w in wanted)


def orchestrator_policy(per_agent: int):
    def policy(messages, tools):
        wanted = listed_modules(messages[1]["content"])
        if not any(m["role"] == "tool" for m in messages):
            chunks = [wanted[i : i + per_agent] for i in range(0, len(wanted), per_agent)]
            calls = [("create_subagent", {"name": f"reader{i}"}) for i in range(len(chunks))]
            calls += [("assign_task", {"agent": f"reader{i}", "task": task_text(c)}) for i, c in enumerate(chunks)]
            return format_tool_calls(calls)
        return "\n".join(
            m["content"] for m in messages if m["role"] == "tool" and not m["content"].startswith("Created")
        )

    return policy


def quality(answer: str | None, docs, names) -> float:
    answer = " ".join((answer or "").split())
    return sum(first_sentence(docs[n]) in answer for n in names) / len(names)


def check_server(base_url: str, timeout: float = 10.0) -> None:
    """That an OpenAI-compatible server answers at base_url (GET /models; any HTTP answer counts: some servers do not
    list models), so that an unreachable one is one line before the runs instead of every request failing."""
    url = base_url.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            json.loads(r.read() or b"{}")
    except urllib.error.HTTPError:
        return  # the server answered
    except (urllib.error.URLError, OSError) as e:  # refused, unknown host, timed out
        raise ConnectionError(f"--base-url {base_url}: no server answers ({getattr(e, 'reason', e)})") from None
    except ValueError:
        raise ValueError(
            f"--base-url {base_url}: {url} does not answer JSON (not an OpenAI-compatible server?)"
        ) from None


def check_args(args) -> None:
    """Bad input, found before any run (ValueError / OSError naming the argument)."""
    if not 1 <= args.modules <= len(MODULES):
        raise ValueError(f"--modules must be in 1..{len(MODULES)}, got {args.modules}")
    check_positive(args, "per_agent", "max_steps", "concurrency", "max_new_tokens")
    if not args.step_latency >= 0:  # NaN too
        raise ValueError(f"--step-latency must be >= 0, got {args.step_latency}")
    check_output_folder(args.out)
    if args.backend == "scripted":
        return
    if not args.model:
        raise ValueError(f"--model is required with --backend {args.backend}")
    if args.backend == "transformers":
        check_model_folder(args.model, what="--model", model_types=served_model_types())
    else:
        if not args.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
        check_server(args.base_url)


def backends(args):
    if args.backend == "scripted":
        return (
            ScriptedBackend(reader_policy, latency=args.step_latency),
            ScriptedBackend(orchestrator_policy(args.per_agent), latency=args.step_latency),
            ScriptedBackend(reader_policy, latency=args.step_latency),
        )
    if args.backend == "openai":
        b = OpenAIBackend(args.base_url, args.model, max_tokens=args.max_new_tokens, max_connections=args.concurrency)
        return b, b, b
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kimi_hf  # noqa: F401  (Auto classes)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    b = TransformersBackend(model, tok, max_new_tokens=args.max_new_tokens, max_batch_size=args.concurrency)
    return b, b, b


def main(argv=None) -> dict:
    # one-line usage errors (`PROG: error: ...`, exit 2), for argparse's checks and for check_args'
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", type=int, default=24, help=f"documents to cover (<= {len(MODULES)})")
    p.add_argument("--per-agent", type=int, default=4, help="scripted orchestrator: modules per sub-agent")
    p.add_argument(
        "--max-steps", type=int, default=32, help="step budget of every agent (serial agent and sub-agents)"
    )
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--step-latency", type=float, default=0.2, help="scripted: seconds per model call")
    p.add_argument("--backend", choices=["scripted", "openai", "transformers"], default="scripted")
    p.add_argument("--model", help="openai: the served model name; transformers: a model directory")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--out", default="outputs/swarm_wide_search")
    args = p.parse_args(argv)
    try:
        check_args(args)
    except (ValueError, TypeError, OSError) as e:
        p.error(" ".join(str(e).split()))
    os.makedirs(args.out, exist_ok=True)
    docs = load_docs(MODULES)
    names = [n for n in MODULES if n in docs][: args.modules]
    tools = make_tools(docs)
    single, orchestrator, sub = backends(args)

    serial = run_single_agent(
        single,
        task_text(names),
        tools=tools,
        max_steps=args.max_steps,
        trace_path=os.path.join(args.out, "serial.jsonl"),
    )
    n_agents = math.ceil(len(names) / args.per_agent)
    swarm = Swarm(
        orchestrator,
        sub,
        tools=tools,
        max_subagents=max(n_agents, 16),
        max_concurrency=args.concurrency,
        max_subagent_steps=args.max_steps,
        max_orchestrator_steps=args.max_steps,
    )
    parallel = swarm.run(task_text(names), trace_path=os.path.join(args.out, "swarm.jsonl"))

    print(
        f"\n# wide search over {len(names)} stdlib module docs, {args.backend} agents, "
        f"step budget {args.max_steps} per agent, {args.step_latency if args.backend == 'scripted' else '-'} s per scripted call\n"
    )
    print("| mode | status | critical steps | total steps | sub-agents | parallelism | wall s | quality |")
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    for label, r in (("single agent", serial), ("swarm", parallel)):
        m = r.metrics
        rows[label] = {**m, "quality": quality(r.answer, docs, names)}
        print(
            f"| {label} | {r.status} | {m['critical_steps']} | {m['total_steps']} | {m['num_subagents']} | "
            f"{m['parallelism']:.2f} | {m['wall_time']:.2f} | {rows[label]['quality']:.2f} |"
        )
    s, w = rows["single agent"], rows["swarm"]
    for label, r in (("single agent", serial), ("swarm", parallel)):
        if r.error:
            print(f"{label}: {r.error}")
    qualities = f"quality {s['quality']:.2f} (single agent) vs {w['quality']:.2f} (swarm)"
    if serial.status == parallel.status == "finished":
        print(
            f"\ncritical steps: {s['critical_steps'] / max(w['critical_steps'], 1):.1f}x fewer with the swarm; "
            f"wall time {s['wall_time'] / max(w['wall_time'], 1e-9):.1f}x; {qualities}; traces in {args.out}/"
        )
    else:  # a failed or cut-short run is fast for the wrong reason: its ratio is no speed-up
        print(
            f"\nno speed-up reported: both runs must finish (single agent: {serial.status}, swarm: "
            f"{parallel.status}); {qualities}; traces in {args.out}/"
        )
    return rows


if __name__ == "__main__":
    # a run that failed (the server went away, a backend error) is no comparison: exit status 1
    sys.exit(1 if any(row["status"] == "error" for row in main().values()) else 0)
