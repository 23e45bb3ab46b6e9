"""critical_steps and the other metrics on hand-written traces."""

import pytest

from kimi_hf.swarm import swarm_metrics


def step(role, stage, run=None):
    return {"type": "step", "role": role, "stage": stage, "run": run, "agent": "x"}


def task(stage, run, status="finished"):
    return {"type": "task", "stage": stage, "run": run, "status": status, "agent": f"a{run}"}


def test_critical_steps_by_hand():
    # stage 0: orchestrator 1 step, runs of 3 and 5 steps -> 1 + 5
    # stage 1: orchestrator 1 step, one run of 2 steps -> 1 + 2
    # stage 2: orchestrator answers -> 1
    events = [step("orchestrator", 0)] + [step("subagent", 0, 1)] * 3 + [step("subagent", 0, 2)] * 5
    events += [task(0, 1), task(0, 2, "timeout")]
    events += [step("orchestrator", 1)] + [step("subagent", 1, 3)] * 2 + [task(1, 3)]
    events += [
        step("orchestrator", 2),
        {"type": "create", "agent": "a", "stage": 0},
        {"type": "create", "agent": "b", "stage": 0},
    ]
    events += [{"type": "final", "status": "finished", "answer": "x", "wall_time": 1.5}]
    m = swarm_metrics(events)
    assert m["critical_steps"] == 6 + 3 + 1
    assert m["total_steps"] == 3 + 3 + 5 + 2
    assert m["parallelism"] == pytest.approx(13 / 10)
    assert (m["num_subagents"], m["num_tasks"], m["finished_tasks"]) == (2, 3, 2)
    assert m["finish_rate"] == pytest.approx(2 / 3)
    assert m["max_width"] == 2 and m["stages"] == 3
    assert m["status"] == "finished" and m["wall_time"] == 1.5


def test_serial_agent_trace():
    m = swarm_metrics([step("orchestrator", 0)] * 7)
    assert m["critical_steps"] == m["total_steps"] == 7 and m["parallelism"] == 1.0
    assert m["finish_rate"] == 0.0 and m["num_tasks"] == 0 and m["status"] is None


def test_empty_trace():
    m = swarm_metrics([])
    assert m["critical_steps"] == 0 and m["parallelism"] == 0.0
