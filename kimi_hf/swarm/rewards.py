"""PARL rewards (Kimi K2.5's PARL, arXiv 2602.02276) as TRL GRPOTrainer reward functions:

    r = lambda1(t) * r_parallel + lambda2(t) * r_finish + r_perf

The exact forms are unpublished; these are the documented defaults:
- r_parallel = min(1, widest stage / target_width): the most sub-agent runs started in one orchestrator
  turn, saturating at `target_width` (default 4). No sub-agents, or one at a time ("serial collapse"),
  scores 0 or 1 / target_width.
- r_finish = finished runs / max(runs, sub-agents created): runs that failed, timed out or ran out of
  steps count against it, and so do sub-agents created but never given a task ("spawned but never
  finished"). 0 without sub-agents.
- r_perf = perf_fn(answer, **dataset columns of that row): the task outcome, user-supplied.
- lambda_i(t) = lambda_i * max(0, 1 - global_step / (anneal_fraction * max_steps)) from TRL's
  `trainer_state` (defaults lambda1 = lambda2 = 0.3, anneal_fraction = 0.5: zero for the second half).
  The lambdas are applied inside r_parallel / r_finish, so GRPOConfig.reward_weights stay 1.

Each completion's episode comes from a dataset column (`trace_column`, default "swarm_trace": a trace's
events, a JSONL path, or a SwarmResult) or, when the row has none, from `rollout(prompt, completion)`
(e.g. SwarmRollout, which plays the completion as the orchestrator's first turn with frozen
sub-agents); each episode is played once and shared by the three functions.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from .runtime import Swarm, SwarmResult
from .tools import format_tool_calls
from .trace import Trace, swarm_metrics


def annealed(initial: float, trainer_state=None, anneal_fraction: float = 0.5) -> float:
    """initial * max(0, 1 - step / (anneal_fraction * max_steps)); `initial` without a trainer_state."""
    if trainer_state is None or not getattr(trainer_state, "max_steps", 0):
        return initial
    horizon = anneal_fraction * trainer_state.max_steps
    return initial * max(0.0, 1.0 - trainer_state.global_step / horizon) if horizon > 0 else 0.0


def r_parallel(metrics: dict, target_width: int = 4) -> float:
    return min(1.0, metrics["max_width"] / target_width)


def r_finish(metrics: dict) -> float:
    denominator = max(metrics["num_tasks"], metrics["num_subagents"])
    return metrics["finished_tasks"] / denominator if denominator else 0.0


def _text(x) -> str:
    """A TRL prompt / completion: a string, or (conversational) a list of messages -> the last content,
    with an assistant message's tool calls rendered in Kimi's markup so that they are played."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and x and isinstance(x[-1], dict):
        message = x[-1]
        text = message.get("content") or ""
        if not isinstance(text, str):
            text = " ".join(p.get("text", "") for p in text if isinstance(p, dict))
        calls = [
            (c.get("function", c)["name"], c.get("function", c)["arguments"]) for c in message.get("tool_calls") or []
        ]
        return format_tool_calls(calls, text)
    raise TypeError(f"expected a string or a list of messages, got {type(x).__name__}")


class SwarmRollout:
    """rollout(prompt, completion) -> SwarmResult: the prompt's last user message is the task, the
    completion is the orchestrator's first turn; later turns come from the swarm's orchestrator backend."""

    def __init__(self, swarm: Swarm):
        if not isinstance(swarm, Swarm):
            raise TypeError(f"swarm must be a Swarm, got {type(swarm).__name__}")
        self.swarm = swarm

    def __call__(self, prompt, completion) -> SwarmResult:
        return self.swarm.run(_text(prompt), forced_orchestrator_outputs=[_text(completion)])


class ParlRewards:
    """Three GRPOTrainer reward functions sharing one episode per completion:
    `GRPOTrainer(..., reward_funcs=ParlRewards(...).reward_funcs)`."""

    def __init__(
        self,
        rollout: Callable | None = None,
        perf_fn: Callable | None = None,
        lambda1: float = 0.3,
        lambda2: float = 0.3,
        anneal_fraction: float = 0.5,
        target_width: int = 4,
        trace_column: str = "swarm_trace",
        cache_size: int = 4096,
    ):
        if rollout is not None and not callable(rollout):
            raise TypeError("rollout must be callable: rollout(prompt, completion) -> SwarmResult or trace events")
        if perf_fn is not None and not callable(perf_fn):
            raise TypeError("perf_fn must be callable: perf_fn(answer, **columns) -> float")
        for name, v in (("lambda1", lambda1), ("lambda2", lambda2)):
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        if not isinstance(anneal_fraction, (int, float)) or not 0 < anneal_fraction <= 1:
            raise ValueError(f"anneal_fraction must be in (0, 1], got {anneal_fraction!r}")
        if not isinstance(target_width, int) or target_width < 1:
            raise ValueError(f"target_width must be a positive integer, got {target_width!r}")
        self.rollout, self.perf_fn = rollout, perf_fn
        self.lambda1, self.lambda2, self.anneal_fraction = lambda1, lambda2, anneal_fraction
        self.target_width, self.trace_column = target_width, trace_column
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_size

    @property
    def reward_funcs(self) -> list[Callable]:
        return [self.r_parallel, self.r_finish, self.r_perf]

    def _episode(self, i: int, prompts, completions, columns) -> tuple[dict, str | None]:
        """(metrics, answer) of row i."""
        given = columns.get(self.trace_column)
        source = given[i] if given is not None else None
        if source is None:
            if self.rollout is None:
                raise ValueError(f"row {i} has no {self.trace_column!r} column value and no rollout was given")
            key = (repr(prompts[i]), repr(completions[i]))
            if key not in self._cache:
                self._cache[key] = self.rollout(prompts[i], completions[i])
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            source = self._cache[key]
        if isinstance(source, (str, os.PathLike)):
            source = Trace.load(source)
        if isinstance(source, SwarmResult):
            return source.metrics, source.answer
        events = source.events if isinstance(source, Trace) else list(source)
        final = next((e for e in reversed(events) if e.get("type") == "final"), {})
        return swarm_metrics(events), final.get("answer")

    def r_parallel(self, prompts, completions, trainer_state=None, **columns) -> list[float]:
        weight = annealed(self.lambda1, trainer_state, self.anneal_fraction)
        return [
            weight * r_parallel(self._episode(i, prompts, completions, columns)[0], self.target_width)
            for i in range(len(completions))
        ]

    def r_finish(self, prompts, completions, trainer_state=None, **columns) -> list[float]:
        weight = annealed(self.lambda2, trainer_state, self.anneal_fraction)
        return [weight * r_finish(self._episode(i, prompts, completions, columns)[0]) for i in range(len(completions))]

    def r_perf(self, prompts, completions, trainer_state=None, **columns) -> list[float | None]:
        if self.perf_fn is None:
            return [None] * len(completions)  # TRL skips None rewards
        row_columns = {k: v for k, v in columns.items() if k not in (self.trace_column, "completion_ids")}
        out = []
        for i in range(len(completions)):
            answer = self._episode(i, prompts, completions, columns)[1]
            row = {k: v[i] for k, v in row_columns.items() if isinstance(v, list) and len(v) == len(completions)}
            out.append(float(self.perf_fn(answer, **row)))
        return out


__all__ = ["ParlRewards", "SwarmRollout", "annealed", "r_parallel", "r_finish"]
