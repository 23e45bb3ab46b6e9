"""The wide-search environment of the PARL claim (benchmarks/claims/parl.py), on kimi_hf's swarm runtime.

A task: the values of items 1..N (N uniform in 4..16) of one database `k0`..`k7`:

    prompt    db k3 find 8                      the orchestrator's user message, as the policy reads it

Each item takes two tool calls: `search(db, item)` -> a document id, then `read(doc)` -> `item=value`. The answer
lists `item=value` for every item; r_perf is the fraction of the task's items it gets right.

The policy writes the orchestrator's first turn in a compact plan language (one token a word):

    plan      k3 1 2 ; k3 3 ; k3 4 5 ; k3 6     four sub-agents, tasks "k3 1 2", "k3 3", "k3 4 5", "k3 6"
    plan      @                                 no sub-agent: the orchestrator starts on the items itself

Each `;`-separated spec other than `@` becomes create_subagent(name=wI) + assign_task(agent=wI, task=SPEC): the
sub-agent reads exactly the words the orchestrator wrote, and has none of its context. `@` becomes the
orchestrator's own search call for the first item no spec names. `to_markup` writes these calls in Kimi's
tool-call markup and `SwarmRollout` plays them as the orchestrator's first turn; the rest of the episode is the
swarm runtime's (stages, budgets, the trace and its metrics) with frozen scripted agents:

- a sub-agent (`subagent_policy`) reads its task as `KEY ITEM ...`, searches and reads its items one tool call a
  step, then answers `item=value ...`. A badly specified sub-task fails: no key or no item, a word that is not an
  item, the wrong database, an item the database does not have (the search fails and the sub-agent gives up).
  It has `MAX_SUBAGENT_STEPS` = 5 steps, two items and its answer: a sub-task of three items or more runs out of
  steps and never finishes. A failed run costs only the steps it took: spawning is cheap.
- the orchestrator's later turns (`orchestrator_policy`) do, serially, one tool call a turn, the items no
  sub-agent was given, then answer with every value that came back. Items lost with a failed sub-agent stay lost:
  a badly specified sub-task costs r_perf.
- the episode's budget: `budget` = 21 critical steps (Kimi K2.5's: each stage's orchestrator step plus its
  longest sub-agent run). Serial work takes 2 N + 1 (the serial agent, `serial_critical_steps`), so it fits for
  N <= 10 and runs out on the wider tasks (the episode ends without an answer, r_perf 0). A finished fan-out of
  sub-tasks of at most two items takes 1 + 5 + 1 = 7 (5 with one item each), whatever N.

So neither failure mode is built in: serial work is safe but too slow for the widest tasks; a fan-out is fast
only when its sub-tasks are well specified and small, and since a failed sub-agent costs little, fan-outs padded
with sub-agents that never finish score r_parallel (which counts every run) at little cost in r_perf.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from kimi_hf.swarm import (
    Completion,
    ScriptedBackend,
    Swarm,
    SwarmRollout,
    ToolCall,
    format_tool_calls,
    run_single_agent,
)


ITEMS = [str(i) for i in range(1, 17)]
KEYS = [f"k{i}" for i in range(8)]
SEP, SELF = ";", "@"
PAD, EOS = "<pad>", "<eos>"
VOCAB = [PAD, EOS, "db", "find", SEP, SELF, *KEYS, *ITEMS]
MIN_ITEMS, MAX_ITEMS = 4, 16
MAX_SUBAGENT_STEPS = 5  # two items (search + read each) and the answer
BUDGET = 21  # critical steps: serial work (2 N + 1) fits for N <= 10
MAX_SUBAGENTS = 16


@dataclass(frozen=True)
class Task:
    """Find the values of items 1..n in database `key`."""

    key: str
    n: int

    @property
    def items(self) -> tuple[str, ...]:
        return tuple(str(i) for i in range(1, self.n + 1))

    @property
    def prompt(self) -> str:
        return f"db {self.key} find {self.n}"

    @classmethod
    def parse(cls, prompt: str) -> "Task":
        words = prompt.split()
        if len(words) != 4 or words[0] != "db" or words[1] not in KEYS or words[2] != "find" or words[3] not in ITEMS:
            raise ValueError(f"not a task prompt: {prompt!r}")
        return cls(words[1], int(words[3]))


def value(key: str, item: str) -> str:
    """The database's value of an item: a fixed, arbitrary 3-digit number."""
    return str(int(hashlib.sha256(f"{key}/{item}".encode()).hexdigest()[:6], 16) % 900 + 100)


def sample_tasks(n: int, seed: int) -> list[Task]:
    """n tasks: a random database, widths uniform in MIN_ITEMS..MAX_ITEMS."""
    rng = random.Random(seed)
    return [Task(rng.choice(KEYS), rng.randint(MIN_ITEMS, MAX_ITEMS)) for _ in range(n)]


# ---- the policy's plan language -------------------------------------------------------------------------------


def specs(plan: str) -> list[list[str]]:
    """A plan's `;`-separated specs (empty ones dropped)."""
    out, current = [], []
    for word in plan.split():
        if word == SEP:
            out.append(current)
            current = []
        else:
            current.append(word)
    out.append(current)
    return [s for s in out if s]


def plan_calls(task: Task, plan: str) -> list[tuple[str, dict]]:
    """The orchestrator's first-turn tool calls a plan stands for (see the module docstring)."""
    calls, assigns, own = [], [], False
    named = {w for s in specs(plan) if s != [SELF] for w in s}
    for spec in specs(plan):
        if spec == [SELF]:
            own = True
            continue
        name = f"w{len(assigns)}"
        calls.append(("create_subagent", {"name": name}))
        assigns.append(("assign_task", {"agent": name, "task": " ".join(spec)}))
    todo = [i for i in task.items if i not in named]
    return calls + assigns + ([("search", {"db": task.key, "item": todo[0]})] if own and todo else [])


def to_markup(task: Task, plan: str) -> str:
    """The first turn in Kimi's tool-call markup (what SwarmRollout plays); a plan without calls is an empty reply."""
    calls = plan_calls(task, plan)
    return format_tool_calls(calls) if calls else ""


def plan_of(split: list[list[str]] | None, key: str) -> str:
    """A plan from item groups (None: serial, `@`)."""
    return SELF if split is None else f" {SEP} ".join(" ".join([key, *group]) for group in split)


# ---- the frozen agents and the tools --------------------------------------------------------------------------


def make_tools(task: Task):
    def search(db: str, item: str) -> str:
        """Finds the document of an item in a database.

        Args:
            db: the database, e.g. "k3".
            item: the item, e.g. "3".
        """
        if db != task.key or item not in task.items:
            raise KeyError(f"no item {item!r} in database {db!r}")
        return f"doc-{item}"

    def read(doc: str) -> str:
        """Reads a document: `item=value`.

        Args:
            doc: a document id from search.
        """
        if not doc.startswith("doc-") or doc[4:] not in task.items:
            raise KeyError(f"no document {doc!r}")
        return f"{doc[4:]}={value(task.key, doc[4:])}"

    return [search, read]


def _call(name: str, **arguments) -> Completion:
    return Completion("", [ToolCall(name, arguments)])


def _own_work(messages, key: str, todo, answer) -> Completion:
    """One serial step: read the document the agent's last search found, or search the next item of `todo`
    without a value; with every one done, the answer: `item=value` for each item of `answer` with a value."""
    found, last = {}, None
    for m in messages:
        if m["role"] == "tool":
            last = m
            for pair in m["content"].split():
                item, eq, v = pair.partition("=")
                if eq and item in ITEMS and v.isdigit():
                    found[item] = v
    if last is not None and last.get("name") == "search" and last["content"].startswith("doc-"):
        return _call("read", doc=last["content"])
    missing = [i for i in todo if i not in found]
    if missing:
        return _call("search", db=key, item=missing[0])
    return Completion(" ".join(f"{i}={found[i]}" for i in answer if i in found))


def subagent_policy(messages, tools):
    """A frozen sub-agent: `KEY ITEM ...` -> search and read each item, then `item=value ...`; gives up (raises,
    a failed run) on a badly specified task or a failed tool call."""
    words = messages[1]["content"].split()
    if len(words) < 2 or words[0] not in KEYS or any(w not in ITEMS for w in words[1:]):
        raise ValueError(f"badly specified sub-task {messages[1]['content']!r}: expected KEY ITEM [ITEM ...]")
    last = messages[-1]
    if last["role"] == "tool" and last["content"].startswith("Error"):
        raise RuntimeError(f"gave up: {last['content']}")
    items = list(dict.fromkeys(words[1:]))
    return _own_work(messages, words[0], items, items)


def delegated(messages) -> set[str]:
    """The words of every task the orchestrator assigned so far."""
    return {
        w
        for m in messages
        if m["role"] == "assistant"
        for c in m.get("tool_calls") or []
        if c["function"]["name"] == "assign_task" and isinstance(c["function"]["arguments"], dict)
        for w in str(c["function"]["arguments"].get("task", "")).split()
    }


def orchestrator_policy(messages, tools):
    """The frozen orchestrator after the plan: the items it delegated to no sub-agent, serially, then the answer
    (what came back; an item lost with a failed sub-agent is not redone)."""
    task = Task.parse(messages[1]["content"])
    given = delegated(messages)
    return _own_work(messages, task.key, [i for i in task.items if i not in given], task.items)


def serial_policy(messages, tools):
    """The serial agent: the same tools, every item in turn, no sub-agents."""
    return orchestrator_policy(messages, tools)


def make_swarm(task: Task, budget: int = BUDGET) -> Swarm:
    tools = make_tools(task)
    return Swarm(
        ScriptedBackend(orchestrator_policy),
        ScriptedBackend(subagent_policy),
        tools=tools,
        orchestrator_tools=tools,
        max_subagents=MAX_SUBAGENTS,
        max_concurrency=MAX_SUBAGENTS,
        max_subagent_steps=MAX_SUBAGENT_STEPS,
        max_orchestrator_steps=2 * MAX_ITEMS + 2,
        max_critical_steps=budget,
        subagent_timeout=None,
        orchestrator_prompt="",
        subagent_prompt="",
    )


def rollout(prompt: str, plan: str, budget: int = BUDGET):
    """ParlRewards' rollout: plays `plan` as the orchestrator's first turn of the task `prompt` (a SwarmResult)."""
    task = Task.parse(prompt)
    return SwarmRollout(make_swarm(task, budget))(task.prompt, to_markup(task, plan))


def score(answer: str | None, prompt: str) -> float:
    """r_perf: the fraction of the task's items whose `item=value` the answer gives."""
    task = Task.parse(prompt)
    given = set((answer or "").split())
    return sum(f"{i}={value(task.key, i)}" in given for i in task.items) / len(task.items)


def serial_critical_steps(task: Task) -> int:
    """The serial agent's critical steps to finish the task (no budget): every step is critical."""
    result = run_single_agent(ScriptedBackend(serial_policy), task.prompt, tools=make_tools(task), max_steps=64)
    if result.status != "finished" or score(result.answer, task.prompt) != 1.0:
        raise RuntimeError(f"the serial agent did not solve {task.prompt!r}: {result.status} {result.error}")
    return result.metrics["critical_steps"]


def random_split(items, rng: random.Random) -> list[list[str]]:
    """The items, in order, cut into a random number (1..N) of non-empty groups of random sizes."""
    n = len(items)
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, n - 1)))
    bounds = [0, *cuts, n]
    return [list(items[a:b]) for a, b in zip(bounds, bounds[1:])]


def sft_example(task: Task, rng: random.Random, serial_fraction: float = 0.5) -> str:
    """A warm-start trace: serial work (`@`) with probability serial_fraction, else a random fan-out."""
    return plan_of(None if rng.random() < serial_fraction else random_split(task.items, rng), task.key)


__all__ = [
    "BUDGET",
    "EOS",
    "PAD",
    "Task",
    "VOCAB",
    "plan_calls",
    "plan_of",
    "rollout",
    "sample_tasks",
    "score",
    "serial_critical_steps",
    "sft_example",
    "specs",
    "to_markup",
]
