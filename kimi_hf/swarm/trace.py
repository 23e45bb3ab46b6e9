"""The swarm's trace (one JSON object per line) and the metrics computed from it.

Events (field `type`):
- "step": one model call: agent, role ("orchestrator" | "subagent"), stage, run (sub-agent run id or
  null), step (1-based within the agent's run), tool_calls (names), prompt_tokens, completion_tokens,
  start, end (seconds since the run began).
- "create": a sub-agent was created: agent, stage.
- "task": a sub-agent run ended: agent, run, stage, steps, status ("finished" | "failed" | "timeout" |
  "step_budget" | "cancelled"), error (or null), start, end.
- "final": the episode ended: status, answer, error (or null), wall_time.

critical_steps = sum over stages of (orchestrator steps in the stage + the longest sub-agent run in the
stage, in steps) (Kimi K2.5's agent swarm, arXiv 2602.02276); parallelism = total_steps / critical_steps.
"""

from __future__ import annotations

import json
import os
import threading
from collections import defaultdict
from collections.abc import Iterable


class Trace:
    """Collects events in memory and, with `path`, appends each as a JSON line as it happens."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.events: list[dict] = []
        self.path = os.fspath(path) if path is not None else None
        self._lock = threading.Lock()
        if self.path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            open(self.path, "w").close()

    def add(self, **event) -> dict:
        with self._lock:
            self.events.append(event)
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps(event) + "\n")
        return event

    @staticmethod
    def load(path: str | os.PathLike) -> list[dict]:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]


def swarm_metrics(events: Iterable[dict]) -> dict:
    """Metrics of one episode's events (a Trace, its .events, or a loaded JSONL list)."""
    events = list(events.events if isinstance(events, Trace) else events)
    orchestrator_steps: dict[int, int] = defaultdict(int)
    run_steps: dict[int, dict] = defaultdict(lambda: defaultdict(int))
    total = 0
    for e in events:
        if e.get("type") != "step":
            continue
        total += 1
        if e["role"] == "orchestrator":
            orchestrator_steps[e["stage"]] += 1
        else:
            run_steps[e["stage"]][e["run"]] += 1
    stages = set(orchestrator_steps) | set(run_steps)
    critical = sum(orchestrator_steps[s] + max(run_steps[s].values(), default=0) for s in stages)
    tasks = [e for e in events if e.get("type") == "task"]
    finished = sum(e["status"] == "finished" for e in tasks)
    created = sum(e.get("type") == "create" for e in events)
    widths = defaultdict(int)
    for e in tasks:
        widths[e["stage"]] += 1
    final = next((e for e in reversed(events) if e.get("type") == "final"), None)
    return {
        "critical_steps": critical,
        "total_steps": total,
        "num_subagents": created,
        "num_tasks": len(tasks),
        "finished_tasks": finished,
        "finish_rate": finished / len(tasks) if tasks else 0.0,
        "max_width": max(widths.values(), default=0),
        "parallelism": total / critical if critical else 0.0,
        "stages": len(stages),
        "status": final["status"] if final else None,
        "wall_time": final["wall_time"] if final else None,
    }


__all__ = ["Trace", "swarm_metrics"]
