"""PARL reward functions on crafted traces, the lambda annealing, and playing GRPO completions."""

from types import SimpleNamespace

import pytest

from kimi_hf.swarm import ParlRewards, ScriptedBackend, Swarm, SwarmRollout, annealed, format_tool_calls

from .helpers import lookup, worker


def trace(widths, finished=None, created=None, answer="A"):
    """Events of an episode with one stage per entry of `widths` (runs started in that stage)."""
    events, run = [], 0
    finished = sum(widths) if finished is None else finished
    for stage, w in enumerate(widths):
        events.append({"type": "step", "role": "orchestrator", "stage": stage, "run": None})
        for _ in range(w):
            run += 1
            events.append({"type": "step", "role": "subagent", "stage": stage, "run": run})
            events.append(
                {
                    "type": "task",
                    "stage": stage,
                    "run": run,
                    "agent": f"a{run}",
                    "status": "finished" if run <= finished else "timeout",
                }
            )
    for i in range(sum(widths) if created is None else created):
        events.append({"type": "create", "agent": f"a{i}", "stage": 0})
    events.append({"type": "final", "status": "finished", "answer": answer, "wall_time": 1.0})
    return events


def rewards_of(parl, traces, **columns):
    n = len(traces)
    kw = dict(prompts=["p"] * n, completions=["c"] * n, swarm_trace=traces, **columns)
    return parl.r_parallel(**kw), parl.r_finish(**kw), parl.r_perf(**kw)


def test_serial_collapse_scores_low_parallel_reward():
    parl = ParlRewards(lambda1=1.0, lambda2=1.0, target_width=4)
    wide, serial, alone = trace([4]), trace([1, 1, 1, 1]), trace([])
    r_par, r_fin, _ = rewards_of(parl, [wide, serial, alone])
    assert r_par == [1.0, 0.25, 0.0]
    assert r_fin == [1.0, 1.0, 0.0]


def test_spawned_but_never_finished_scores_low_finish_reward():
    parl = ParlRewards(lambda1=1.0, lambda2=1.0)
    spawned_idle = trace([], created=6)  # six created, no task ever assigned
    failing = trace([4], finished=1)  # four runs, three timed out
    good = trace([3, 2])
    r_par, r_fin, _ = rewards_of(parl, [spawned_idle, failing, good])
    assert r_fin == [0.0, 0.25, 1.0]
    assert r_par == [0.0, 1.0, 0.75]


def test_perf_reward_sees_the_answer_and_the_row_columns():
    parl = ParlRewards(perf_fn=lambda answer, solution: float(answer == solution))
    _, _, r_perf = rewards_of(parl, [trace([1], answer="42"), trace([1], answer="41")], solution=["42", "42"])
    assert r_perf == [1.0, 0.0]
    assert ParlRewards().r_perf(["p"], ["c"], swarm_trace=[trace([1])]) == [None]  # no perf_fn: skipped


def test_lambdas_anneal_to_zero_through_trainer_state():
    parl = ParlRewards(lambda1=0.5, lambda2=0.2, anneal_fraction=0.5)
    t = [trace([4])]
    at = lambda step: SimpleNamespace(global_step=step, max_steps=100)  # noqa: E731
    assert parl.r_parallel(["p"], ["c"], trainer_state=at(0), swarm_trace=t) == [0.5]
    assert parl.r_parallel(["p"], ["c"], trainer_state=at(25), swarm_trace=t) == [pytest.approx(0.25)]
    assert parl.r_finish(["p"], ["c"], trainer_state=at(25), swarm_trace=t) == [pytest.approx(0.1)]
    assert parl.r_parallel(["p"], ["c"], trainer_state=at(50), swarm_trace=t) == [0.0]
    assert parl.r_parallel(["p"], ["c"], trainer_state=at(90), swarm_trace=t) == [0.0]
    assert annealed(0.3, None) == 0.3


def test_jsonl_paths_and_results_are_accepted(tmp_path):
    result = Swarm(
        ScriptedBackend(
            [
                format_tool_calls(
                    [("create_subagent", {"name": "a"}), ("assign_task", {"agent": "a", "task": "item 0"})]
                ),
                "done",
            ]
        ),
        ScriptedBackend(worker(steps=1)),
    ).run("t", trace_path=tmp_path / "t.jsonl")
    parl = ParlRewards(lambda1=1.0, lambda2=1.0, target_width=2, perf_fn=lambda a: float(a == "done"))
    for source in (str(tmp_path / "t.jsonl"), result, result.trace.events):
        assert [f(["p"], ["c"], swarm_trace=[source])[0] for f in parl.reward_funcs] == [0.5, 1.0, 1.0]


def test_rollout_plays_each_completion_once_for_all_three_functions():
    sub = ScriptedBackend(worker(steps=2))
    orchestrator = ScriptedBackend(lambda m, t: "final answer")  # the turn after the played completion
    parl = ParlRewards(
        SwarmRollout(Swarm(orchestrator, sub, tools=[lookup])),
        perf_fn=lambda a: float(a == "final answer"),
        lambda1=1.0,
        lambda2=1.0,
        target_width=3,
    )
    wide = format_tool_calls(
        [("create_subagent", {"name": f"a{i}"}) for i in range(3)]
        + [("assign_task", {"agent": f"a{i}", "task": f"item {i}"}) for i in range(3)]
    )
    conversational = [
        [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "create_subagent", "arguments": {"name": "solo"}}},
                    {
                        "type": "function",
                        "function": {"name": "assign_task", "arguments": '{"agent": "solo", "task": "item 9"}'},
                    },
                ],
            }
        ]
    ]
    prompts = ["question", [{"role": "user", "content": "question"}], "question"]
    completions = [wide] + conversational + ["I answer directly"]
    scores = [f(prompts, completions) for f in parl.reward_funcs]
    assert scores[0] == [1.0, pytest.approx(1 / 3), 0.0]
    assert scores[1] == [1.0, 1.0, 0.0]
    assert scores[2] == [1.0, 1.0, 0.0]  # the last completion *is* the answer: "I answer directly"
    assert sub.calls == 3 * 2 + 2  # each episode played once, not once per reward function


def test_errors():
    with pytest.raises(ValueError, match="swarm_trace"):
        ParlRewards().r_parallel(["p"], ["c"])
    with pytest.raises(ValueError, match="lambda1"):
        ParlRewards(lambda1=-1)
    with pytest.raises(ValueError, match="anneal_fraction"):
        ParlRewards(anneal_fraction=0)
    with pytest.raises(TypeError, match="rollout"):
        ParlRewards(rollout=3)
    with pytest.raises(TypeError, match="swarm"):
        SwarmRollout("x")
