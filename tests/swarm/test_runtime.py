"""The orchestrator runtime with scripted agents: parallelism bounds, budgets, failures, the trace."""

import asyncio
import json

import pytest

from kimi_hf.swarm import ScriptedBackend, Swarm, SwarmConfig, Trace, format_tool_calls, run_single_agent

from .helpers import fan_out_orchestrator, lookup, tool_results, worker


def test_fan_out_runs_in_parallel_up_to_the_bound_and_returns_only_final_answers(tmp_path):
    sub = ScriptedBackend(worker(steps=3), latency=0.05)
    swarm = Swarm(ScriptedBackend(fan_out_orchestrator(6)), sub, tools=[lookup], max_concurrency=4)
    result = swarm.run("collect six items", trace_path=tmp_path / "trace.jsonl")
    assert result.status == "finished"
    assert result.answer == " | ".join(f"done: item {i} turn 0" for i in range(6))
    assert sub.max_in_flight == 4  # reaches the bound, never exceeds it
    # the orchestrator sees only final answers, never the sub-agents' tool traffic
    assert all("value of" not in m["content"] for m in result.messages if m["role"] == "tool")
    m = result.metrics
    assert (m["num_subagents"], m["num_tasks"], m["finished_tasks"], m["finish_rate"]) == (6, 6, 6, 1.0)
    assert m["total_steps"] == 2 + 6 * 3 and m["critical_steps"] == 2 + 3
    assert m["parallelism"] == pytest.approx(20 / 5) and m["max_width"] == 6
    lines = Trace.load(tmp_path / "trace.jsonl")
    assert lines == json.loads(json.dumps(result.trace.events))
    steps = [e for e in lines if e["type"] == "step"]
    assert {e["role"] for e in steps} == {"orchestrator", "subagent"}
    assert all(e["end"] >= e["start"] for e in steps)
    assert steps[0]["tool_calls"] == ["create_subagent"] * 6 + ["assign_task"] * 6


def test_wall_time_reflects_parallel_runs():
    sub = ScriptedBackend(worker(steps=2), latency=0.1)
    result = Swarm(ScriptedBackend(fan_out_orchestrator(8)), sub, tools=[lookup], max_concurrency=8).run("t")
    # the sub-agents' calls ran at the same time: their traced intervals overlap (a property of the schedule,
    # not of this machine's speed, unlike a bound on the wall time)
    spans = sorted(
        (e["start"], e["end"]) for e in result.trace.events if e["type"] == "step" and e["role"] == "subagent"
    )
    assert len(spans) == 16
    overlap = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlap >= 4, overlap


def test_failures_timeouts_and_budgets_become_tool_errors():
    def sub_policy(messages, tools):
        task = messages[1]["content"]
        if "item 0" in task:
            raise RuntimeError("backend down")
        if "item 1" in task:
            return asyncio.sleep(5, result="too late")
        if "item 2" in task:
            return format_tool_calls([("lookup", {"key": "x"})])  # never answers
        if "item 3" in task:
            return format_tool_calls([("no_such_tool", {})])
        return "fine"

    swarm = Swarm(
        ScriptedBackend(fan_out_orchestrator(4)),
        ScriptedBackend(sub_policy),
        tools=[lookup],
        max_subagent_steps=3,
        subagent_timeout=0.3,
    )
    result = swarm.run("t")
    assert result.status == "finished"
    errors = tool_results(result.messages)[4:]
    assert "backend down" in errors[0] and errors[0].startswith("Error: sub-agent 'a0'")
    assert "timed out after 0.3 s" in errors[1]
    assert "3-step budget" in errors[2]
    assert "3-step budget" in errors[3]  # unknown tools are reported to the sub-agent, which keeps trying
    statuses = [e["status"] for e in result.trace.events if e["type"] == "task"]
    assert sorted(statuses) == ["failed", "step_budget", "step_budget", "timeout"]
    assert result.metrics["finish_rate"] == 0.0


def test_orchestrator_tool_errors_do_not_crash():
    turns = iter(
        [
            format_tool_calls(
                [
                    ("assign_task", {"agent": "ghost", "task": "x"}),
                    ("create_subagent", {"name": "a"}),
                    ("create_subagent", {"name": "a"}),
                    ("create_subagent", {}),
                    ("mystery", {}),
                    ("assign_task", "not json"),
                ]
            ),
            "final",
        ]
    )
    result = Swarm(ScriptedBackend(lambda m, t: next(turns)), max_subagents=1).run("t")
    errs = tool_results(result.messages)
    assert "no sub-agent named 'ghost'" in errs[0] and errs[1] == "Created sub-agent 'a'."
    assert "exists already" in errs[2] and "non-empty string `name`" in errs[3]
    assert "unknown tool 'mystery'" in errs[4] and "not a JSON object" in errs[5]
    assert result.answer == "final"


def test_max_subagents_limit():
    calls = [("create_subagent", {"name": f"a{i}"}) for i in range(3)]
    turns = iter([format_tool_calls(calls), "ok"])
    result = Swarm(ScriptedBackend(lambda m, t: next(turns)), max_subagents=2).run("t")
    assert "limit of 2 sub-agents" in tool_results(result.messages)[2]
    assert result.metrics["num_subagents"] == 2


def test_budgets_end_the_episode():
    loop_forever = ScriptedBackend(lambda m, t: format_tool_calls([("create_subagent", {"name": f"a{len(m)}"})]))
    result = Swarm(loop_forever, max_orchestrator_steps=3, max_subagents=100).run("t")
    assert result.status == "orchestrator_step_budget" and result.answer is None
    assert result.metrics["total_steps"] == 3

    # critical budget 6: turn 1 (1) + runs cut at 4 steps (one step stays reserved for the next turn);
    # turn 2 (6) has no budget left for its runs (tool errors); a turn 3 would be step 7 > 6
    sub = ScriptedBackend(worker(steps=10))
    result = Swarm(ScriptedBackend(fan_out_orchestrator(2, turns=2)), sub, tools=[lookup], max_critical_steps=6).run(
        "t"
    )
    assert result.status == "critical_budget"
    assert result.metrics["critical_steps"] == 6
    tasks = [e for e in result.trace.events if e["type"] == "task"]
    assert len(tasks) == 2 and all(e["steps"] == 4 and e["status"] == "step_budget" for e in tasks)
    assert all("critical-step budget is used up" in r for r in tool_results(result.messages)[-2:])

    # a run that fits leaves the orchestrator its closing turn: the answer is not thrown away
    result = Swarm(
        ScriptedBackend(fan_out_orchestrator(1)),
        ScriptedBackend(worker(steps=4)),
        tools=[lookup],
        max_critical_steps=6,
    ).run("t")
    assert result.status == "finished" and result.answer == "done: item 0 turn 0"
    assert result.metrics["critical_steps"] == 6


def test_episode_timeout_cancels_running_subagents():
    sub = ScriptedBackend(lambda m, t: asyncio.sleep(10, result="late"))
    result = Swarm(ScriptedBackend(fan_out_orchestrator(3)), sub, timeout=0.3, subagent_timeout=None).run("t")
    assert result.status == "timeout" and result.answer is None
    assert [e["status"] for e in result.trace.events if e["type"] == "task"] == ["cancelled"] * 3
    assert result.metrics["wall_time"] < 10  # the sub-agents' 10 s sleeps were cut short, not awaited


def test_stages_and_critical_steps_across_turns():
    sub = ScriptedBackend(worker(steps=2))
    result = Swarm(ScriptedBackend(fan_out_orchestrator(3, turns=2)), sub, tools=[lookup]).run("t")
    m = result.metrics
    assert m["stages"] == 3 and m["critical_steps"] == (1 + 2) + (1 + 2) + 1
    assert m["total_steps"] == 3 + 2 * 3 * 2


def test_single_agent_baseline_is_all_critical():
    result = run_single_agent(ScriptedBackend(worker(steps=4)), "item 0", tools=[lookup])
    assert result.answer == "done: item 0"
    assert result.metrics["critical_steps"] == result.metrics["total_steps"] == 4
    assert result.metrics["parallelism"] == 1.0


def test_bad_arguments_raise_clear_errors():
    backend = ScriptedBackend(["x"])
    with pytest.raises(ValueError, match="max_concurrency"):
        SwarmConfig(max_concurrency=0)
    with pytest.raises(ValueError, match="max_subagent_steps"):
        SwarmConfig(max_subagent_steps=1.5)
    with pytest.raises(TypeError, match="orchestrator"):
        Swarm("not a backend")
    with pytest.raises(ValueError, match="task"):
        Swarm(backend).run("  ")
    with pytest.raises(ValueError, match="swarm's own tools"):

        def create_subagent(name: str):
            """x

            Args:
                name: n
            """

        Swarm(backend, orchestrator_tools=[create_subagent])


def test_scripted_responses_used_up_end_the_episode_in_error():
    result = Swarm(ScriptedBackend([format_tool_calls([("create_subagent", {"name": "a"})])])).run("t")
    assert result.status == "error" and "used up" in result.error and result.answer is None


def test_bad_orchestrator_arguments_and_tool_results_are_tool_errors():
    def weird(x: int):
        """Returns something json cannot write.

        Args:
            x: anything
        """
        return {(1, 2): x}

    turns = iter(
        [
            format_tool_calls(
                [
                    ("create_subagent", {"name": "a"}),
                    ("assign_task", {"agent": ["a"], "task": "x"}),
                    ("assign_task", {"agent": "a", "task": "item 0"}),
                    ("weird", {"x": 1}),
                ]
            ),
            "end",
        ]
    )
    sub = ScriptedBackend(worker(steps=1), latency=0.05)
    result = Swarm(ScriptedBackend(lambda m, t: next(turns)), sub, orchestrator_tools=[weird]).run("t")
    assert result.status == "finished" and result.answer == "end"
    errs = tool_results(result.messages)
    assert "no sub-agent named ['a']" in errs[1] and errs[2] == "done: item 0" and "weird raised TypeError" in errs[3]
    assert result.trace.events[-1]["type"] == "final"  # nothing still running writes after the end


def test_timeout_errors_raised_by_a_backend_are_failures_not_timeouts():
    def raises_timeout(messages, tools):
        raise TimeoutError("upstream read timed out")

    result = Swarm(ScriptedBackend(fan_out_orchestrator(1)), ScriptedBackend(raises_timeout)).run("t")
    task = next(e for e in result.trace.events if e["type"] == "task")
    assert task["status"] == "failed" and "upstream read timed out" in task["error"]
    alone = run_single_agent(ScriptedBackend(raises_timeout), "t")
    assert alone.status == "error" and "upstream read timed out" in alone.error


def test_a_completion_object_shared_between_agents_is_not_mutated():
    from kimi_hf.swarm import Completion, ToolCall

    shared = Completion("", [ToolCall("lookup", {"key": "k"}, "original")])
    backend = ScriptedBackend(lambda m, t: shared if len(m) == 2 else "ok")
    run_single_agent(backend, "a", tools=[lookup])
    assert shared.tool_calls[0].id == "original"
