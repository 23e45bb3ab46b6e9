"""The swarm runtime (Kimi K2.5's agent swarm, arXiv 2602.02276): an orchestrator that creates sub-agents and assigns them tasks through
tool calls; tasks assigned in one orchestrator turn run concurrently (a bounded pool), each sub-agent
in its own context, and only its final answer returns to the orchestrator, as the tool result.

Stage t = one orchestrator turn plus the sub-agent runs it started. Budgets: orchestrator turns,
steps per sub-agent run, critical steps (sum over stages of 1 + the longest run; a run is cut at the
critical budget that is left), a timeout per run and per episode. Failures, timeouts and exhausted
budgets of sub-agents reach the orchestrator as tool errors; a failing orchestrator backend ends the
episode with status "error" (and the message in `error`): an episode never raises, so one bad rollout
cannot stop a training run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, fields
from typing import Any

from .backends import Backend, Completion
from .tools import ORCHESTRATOR_TOOLS, Tool, ToolCall, as_tools
from .trace import Trace, swarm_metrics


ORCHESTRATOR_PROMPT = (
    "You are the orchestrator. Split the task into independent sub-tasks, create sub-agents with "
    "create_subagent and give each a sub-task with assign_task; tasks assigned in the same turn run in "
    "parallel and you receive each sub-agent's final answer. When you can answer, reply without tool calls."
)
SUBAGENT_PROMPT = (
    "You are a sub-agent. Solve the task you are given with the tools you have, then reply with the answer only."
)
AGENT_PROMPT = "Solve the task with the tools you have. When you can answer, reply without tool calls."


@dataclass
class SwarmConfig:
    """Limits of one episode. `max_critical_steps` / timeouts of None mean no limit."""

    max_subagents: int = 16
    max_concurrency: int = 8
    max_orchestrator_steps: int = 16
    max_subagent_steps: int = 16
    max_critical_steps: int | None = None
    subagent_timeout: float | None = 120.0
    timeout: float | None = None
    orchestrator_prompt: str = ORCHESTRATOR_PROMPT
    subagent_prompt: str = SUBAGENT_PROMPT

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_prompt"):
                if not isinstance(value, str):
                    raise TypeError(f"{f.name} must be a string, got {type(value).__name__}")
            elif f.name in ("max_critical_steps", "subagent_timeout", "timeout") and value is None:
                continue
            elif (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value <= 0
                or (f.name.startswith("max_") and not isinstance(value, int))
            ):
                raise ValueError(
                    f"{f.name} must be a positive {'integer' if f.name.startswith('max_') else 'number'}, got {value!r}"
                )


@dataclass
class SwarmResult:
    answer: str | None
    status: str  # finished | orchestrator_step_budget | critical_budget | timeout | error
    trace: Trace
    metrics: dict
    messages: list[dict]  # the orchestrator's (or single agent's) transcript
    error: str | None = None  # status "error": what failed (the orchestrator's backend)


class _Budget(Exception):
    pass


class InnerTimeoutError(RuntimeError):
    """A TimeoutError raised inside an agent (e.g. by a backend), as opposed to the runtime's own limits."""


async def _no_inner_timeouts(coro):
    """Re-raises TimeoutErrors from inside `coro` as InnerTimeoutError, so that a TimeoutError seen
    around it is the runtime's own wait_for limit."""
    try:
        return await coro
    except (asyncio.TimeoutError, TimeoutError) as exc:
        raise InnerTimeoutError(f"TimeoutError: {exc}") from exc


@dataclass
class _Episode:
    trace: Trace
    t0: float
    semaphore: asyncio.Semaphore | None = None
    runs: int = 0

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 6)


def _not_an_object(call: ToolCall) -> str | None:
    if not isinstance(call.arguments, dict):
        return f"Error: the arguments of {call.name} are not a JSON object: {str(call.arguments)[:200]}"
    return None


async def _execute(tool: Tool | None, call: ToolCall) -> str:
    """A tool call -> the tool message content; every error is returned as text, not raised."""
    if tool is None:
        return f"Error: unknown tool {call.name!r}"
    if error := _not_an_object(call):
        return error
    try:
        result = await tool(call.arguments)
        return result if isinstance(result, str) else json.dumps(result, default=str)
    except Exception as exc:  # the agent sees the error and may recover
        return f"Error: {call.name} raised {type(exc).__name__}: {exc}"


def _tool_message(call: ToolCall, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


async def _step(
    backend: Backend,
    messages,
    schemas,
    ep: _Episode,
    *,
    agent: str,
    role: str,
    stage: int,
    run: int | None,
    step: int,
    forced: Completion | None = None,
) -> Completion:
    start = ep.now()
    completion = forced if forced is not None else await backend.complete(messages, schemas or None)
    # call ids must be unique within a conversation (tool results are matched by id): Kimi numbers them
    # functions.NAME:IDX with IDX counting every call so far, whatever the model wrote
    seen = sum(len(m.get("tool_calls") or []) for m in messages if m["role"] == "assistant")
    completion = dataclasses.replace(
        completion,
        tool_calls=[  # copies: a backend may hand the same object to others
            dataclasses.replace(c, id=f"functions.{c.name}:{seen + i}") for i, c in enumerate(completion.tool_calls)
        ],
    )
    ep.trace.add(
        type="step",
        agent=agent,
        role=role,
        stage=stage,
        run=run,
        step=step,
        tool_calls=[c.name for c in completion.tool_calls],
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        start=start,
        end=ep.now(),
    )
    messages.append(completion.to_message())
    return completion


async def _agent_loop(
    backend: Backend,
    messages: list[dict],
    tools: dict[str, Tool],
    max_steps: int,
    ep: _Episode,
    *,
    agent: str,
    role: str,
    stage: int,
    run: int | None,
    progress: list,
) -> str:
    """Model turns until a reply without tool calls (returned); `progress[0]` counts steps as they
    happen (read after a timeout). Raises _Budget after max_steps turns that all called tools."""
    schemas = [t.schema for t in tools.values()]
    for step in range(1, max_steps + 1):
        completion = await _step(
            backend, messages, schemas, ep, agent=agent, role=role, stage=stage, run=run, step=step
        )
        progress[0] = step
        if not completion.tool_calls:
            return completion.content
        for call in completion.tool_calls:
            messages.append(_tool_message(call, await _execute(tools.get(call.name), call)))
    raise _Budget(f"used its {max_steps}-step budget without a final answer")


class Swarm:
    """An orchestrator backend, a sub-agent backend (default: the same), the sub-agents' tools and
    optionally tools of the orchestrator's own. `run(task)` plays one episode; `arun` is its
    coroutine. Sub-agent tool calls go to `tools` (functions or Tool objects)."""

    def __init__(
        self,
        orchestrator: Backend,
        subagent: Backend | None = None,
        tools=(),
        orchestrator_tools=(),
        config: SwarmConfig | None = None,
        **config_kwargs,
    ):
        if not isinstance(orchestrator, Backend):
            raise TypeError(f"orchestrator must be a Backend, got {type(orchestrator).__name__}")
        if subagent is not None and not isinstance(subagent, Backend):
            raise TypeError(f"subagent must be a Backend, got {type(subagent).__name__}")
        if config is not None and config_kwargs:
            raise ValueError("pass either config or keyword limits, not both")
        self.orchestrator, self.subagent = orchestrator, subagent or orchestrator
        self.tools = as_tools(tools)
        self.orchestrator_tools = as_tools(orchestrator_tools)
        clash = {"create_subagent", "assign_task"} & set(self.orchestrator_tools)
        if clash:
            raise ValueError(f"orchestrator_tools: {sorted(clash)} are the swarm's own tools")
        self.config = config or SwarmConfig(**config_kwargs)

    def run(self, task: str, **kwargs) -> SwarmResult:
        """Blocking episode (inside a running event loop, await `arun` instead)."""
        return asyncio.run(self.arun(task, **kwargs))

    async def arun(self, task: str, trace_path=None, forced_orchestrator_outputs=()) -> SwarmResult:
        """One episode. `forced_orchestrator_outputs` replace the orchestrator's first turns (texts with
        tool-call markup or Completions): how a GRPO completion is played out (see rewards)."""
        if not isinstance(task, str) or not task.strip():
            raise ValueError("task must be a non-empty string")
        ep = _Episode(Trace(trace_path), time.monotonic(), asyncio.Semaphore(self.config.max_concurrency))
        messages = [{"role": "system", "content": self.config.orchestrator_prompt}, {"role": "user", "content": task}]
        forced = [_as_completion(f) for f in forced_orchestrator_outputs]
        answer, status, error = None, "timeout", None
        try:
            answer, status = await asyncio.wait_for(
                _no_inner_timeouts(self._orchestrate(messages, ep, forced)), self.config.timeout
            )
        except (asyncio.TimeoutError, TimeoutError):
            pass
        except Exception as exc:  # the orchestrator's own backend failed: an episode that ended in error
            status, error = "error", f"{type(exc).__name__}: {exc}"
        return _finish(ep, answer, status, error, messages)

    async def _orchestrate(self, messages, ep: _Episode, forced: list[Completion]) -> tuple[str | None, str]:
        cfg = self.config
        schemas = ORCHESTRATOR_TOOLS + [t.schema for t in self.orchestrator_tools.values()]
        agents: dict[str, str] = {}  # name -> system prompt
        critical = 0
        for stage in range(cfg.max_orchestrator_steps):
            if cfg.max_critical_steps is not None and critical + 1 > cfg.max_critical_steps:
                return None, "critical_budget"
            completion = await _step(
                self.orchestrator,
                messages,
                schemas,
                ep,
                agent="orchestrator",
                role="orchestrator",
                stage=stage,
                run=None,
                step=stage + 1,
                forced=forced[stage] if stage < len(forced) else None,
            )
            critical += 1
            if not completion.tool_calls:
                return completion.content, "finished"
            results: dict[int, str] = {}
            for i, call in enumerate(completion.tool_calls):  # creations first: "create A, assign A" in one turn works
                if call.name == "create_subagent":
                    results[i] = self._create(call, agents, ep, stage)
            sub_budget = cfg.max_subagent_steps
            if cfg.max_critical_steps is not None:  # keep one critical step for the orchestrator's next turn
                sub_budget = min(sub_budget, cfg.max_critical_steps - critical - 1)
            jobs, steps = {}, []
            for i, call in enumerate(completion.tool_calls):
                if call.name == "assign_task":
                    jobs[i] = self._assign(call, agents, ep, stage, sub_budget, steps)
                elif i not in results:
                    results[i] = await _execute(self.orchestrator_tools.get(call.name), call)
            # _assign reports its errors as text; return_exceptions keeps every sibling awaited regardless
            for i, content in zip(jobs, await asyncio.gather(*jobs.values(), return_exceptions=True)):
                results[i] = content if isinstance(content, str) else f"Error: assign_task failed: {content!r}"
            critical += max(steps, default=0)
            for i, call in enumerate(completion.tool_calls):
                messages.append(_tool_message(call, results[i]))
        return None, "orchestrator_step_budget"

    def _create(self, call: ToolCall, agents: dict, ep: _Episode, stage: int) -> str:
        if error := _not_an_object(call):
            return error
        args = call.arguments
        name, prompt = args.get("name"), args.get("system_prompt") or self.config.subagent_prompt
        if not isinstance(name, str) or not name.strip():
            return "Error: create_subagent needs a non-empty string `name`"
        if name in agents:
            return f"Error: a sub-agent named {name!r} exists already"
        if len(agents) >= self.config.max_subagents:
            return f"Error: the limit of {self.config.max_subagents} sub-agents is reached"
        if not isinstance(prompt, str):
            return "Error: system_prompt must be a string"
        agents[name] = prompt
        ep.trace.add(type="create", agent=name, stage=stage, time=ep.now())
        return f"Created sub-agent {name!r}."

    async def _assign(self, call: ToolCall, agents: dict, ep: _Episode, stage: int, budget: int, steps: list) -> str:
        if error := _not_an_object(call):
            return error
        args = call.arguments
        name, task = args.get("agent"), args.get("task")
        if not isinstance(name, str) or name not in agents:
            return f"Error: no sub-agent named {name!r} (create it with create_subagent first)"
        if not isinstance(task, str) or not task.strip():
            return "Error: assign_task needs a non-empty string `task`"
        if budget < 1:
            return "Error: the critical-step budget is used up; no sub-agent can run"
        ep.runs += 1
        run, progress = ep.runs, [0]
        messages = [{"role": "system", "content": agents[name]}, {"role": "user", "content": task}]
        status, error, answer = "finished", None, None
        async with ep.semaphore:
            start = ep.now()
            try:
                answer = await asyncio.wait_for(
                    _no_inner_timeouts(
                        _agent_loop(
                            self.subagent,
                            messages,
                            self.tools,
                            budget,
                            ep,
                            agent=name,
                            role="subagent",
                            stage=stage,
                            run=run,
                            progress=progress,
                        )
                    ),
                    self.config.subagent_timeout,
                )
            except _Budget as exc:
                status, error = "step_budget", str(exc)
            except (asyncio.TimeoutError, TimeoutError):
                status, error = "timeout", f"timed out after {self.config.subagent_timeout} s"
            except asyncio.CancelledError:
                ep.trace.add(
                    type="task",
                    agent=name,
                    run=run,
                    stage=stage,
                    steps=progress[0],
                    status="cancelled",
                    error="the episode ended",
                    start=start,
                    end=ep.now(),
                )
                raise
            except Exception as exc:  # a crashing backend or agent is the orchestrator's problem to handle
                status, error = "failed", f"{type(exc).__name__}: {exc}"
        steps.append(progress[0])
        ep.trace.add(
            type="task",
            agent=name,
            run=run,
            stage=stage,
            steps=progress[0],
            status=status,
            error=error,
            start=start,
            end=ep.now(),
        )
        return answer if status == "finished" else f"Error: sub-agent {name!r} {error}"


def _as_completion(output: Any) -> Completion:
    if isinstance(output, Completion):
        return output
    if isinstance(output, str):
        return Completion.from_text(output)
    raise TypeError(f"forced_orchestrator_outputs must hold strings or Completions, got {type(output).__name__}")


async def arun_single_agent(
    backend: Backend,
    task: str,
    tools=(),
    max_steps: int = 64,
    trace_path=None,
    system_prompt: str = AGENT_PROMPT,
    timeout: float | None = None,
) -> SwarmResult:
    """The serial baseline: one agent with the tools and no sub-agents (every step is critical)."""
    if not isinstance(task, str) or not task.strip():
        raise ValueError("task must be a non-empty string")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
    ep = _Episode(Trace(trace_path), time.monotonic())
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": task}]
    answer, status, error = None, "finished", None
    try:
        answer = await asyncio.wait_for(
            _no_inner_timeouts(
                _agent_loop(
                    backend,
                    messages,
                    as_tools(tools),
                    max_steps,
                    ep,
                    agent="agent",
                    role="orchestrator",
                    stage=0,
                    run=None,
                    progress=[0],
                )
            ),
            timeout,
        )
    except _Budget:
        status = "orchestrator_step_budget"
    except (asyncio.TimeoutError, TimeoutError):
        status = "timeout"
    except Exception as exc:
        status, error = "error", f"{type(exc).__name__}: {exc}"
    return _finish(ep, answer, status, error, messages)


def _finish(ep: _Episode, answer, status: str, error: str | None, messages) -> SwarmResult:
    ep.trace.add(type="final", status=status, answer=answer, error=error, wall_time=ep.now())
    return SwarmResult(answer, status, ep.trace, swarm_metrics(ep.trace), messages, error)


def run_single_agent(backend: Backend, task: str, **kwargs) -> SwarmResult:
    return asyncio.run(arun_single_agent(backend, task, **kwargs))


__all__ = ["Swarm", "SwarmConfig", "SwarmResult", "arun_single_agent", "run_single_agent"]
