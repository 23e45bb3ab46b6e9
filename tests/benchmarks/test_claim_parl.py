"""benchmarks/claims/parl.py (`kimi-hf bench claims parl`): its wide-search environment plays scripted plans to the
critical steps, widths and rewards computed by hand (serial work, fan-outs, a badly specified or too big sub-task,
the budget), and its --quick smoke prints well-formed tables (one row per arm, numbers that parse), results.json
and the plot; bad arguments give a one-line usage error. The claims themselves are not asserted: two GRPO steps
say nothing about them."""

import json
import math
import re
import sys

import pytest

from .claims_helpers import CLAIMS, NUMBER, run_claim, seeds_mean
from .test_benchmark_scripts import markdown_tables


SCRIPT = CLAIMS / "parl.py"
sys.path.insert(0, str(CLAIMS))

import parl  # noqa: E402  (benchmarks/claims/parl.py)
import parl_env as env  # noqa: E402

from kimi_hf.swarm import ParlRewards  # noqa: E402


ARMS = ["full PARL", "no r_parallel", "no r_finish", "r_perf only"]
HEADERS = [
    "| policy | success | widest fan-out | no sub-agent | finished | critical steps | vs serial |",
    "| arm | step | success | widest fan-out | finished | critical steps | vs serial |",
    "| claim | reproduced when | measured | reproduced |",
]
TASK = env.Task("k3", 8)
ONE_EACH = " ; ".join(f"k3 {i}" for i in range(1, 9))


def run(*args, timeout=300):
    return run_claim(SCRIPT, *args, timeout=timeout)


def play(plan: str, task=TASK):
    result = env.rollout(task.prompt, plan)
    return result, result.metrics, env.score(result.answer, task.prompt)


# ---- the environment ----------------------------------------------------------------------------------------------


def test_serial_work_takes_two_steps_an_item_and_runs_out_of_budget_past_ten_items():
    result, m, score = play("@")
    assert (result.status, m["critical_steps"], m["max_width"], score) == ("finished", 17, 0, 1.0)
    assert env.serial_critical_steps(TASK) == 17 == 2 * TASK.n + 1  # the serial agent: the same work
    wide = env.Task("k3", 11)
    result, m, score = play("@", wide)
    assert (result.status, result.answer, score) == ("critical_budget", None, 0.0)
    assert m["critical_steps"] == env.BUDGET and env.serial_critical_steps(wide) == 23


@pytest.mark.parametrize(
    "plan, critical, width, finished, score",
    [
        ("k3 1 2 ; k3 3 4 ; k3 5 6 ; k3 7 8", 1 + 5 + 1, 4, 4, 1.0),  # two items each: 2 x 2 + answer
        (ONE_EACH, 1 + 3 + 1, 8, 8, 1.0),
        # a sub-task of three items runs out of its 5 steps and never finishes: its items are lost
        ("k3 1 2 3 ; k3 4 5 ; k3 6 7 ; k3 8", 1 + 5 + 1, 4, 3, 5 / 8),
        # the wrong database: the search fails after one step, the sub-agent gives up
        ("k2 1 2 ; k3 3 4 ; k3 5 6 ; k3 7 8", 1 + 5 + 1, 4, 3, 6 / 8),
        # items 5..8 given to no sub-agent: the orchestrator does them after the stage, 2 turns each
        ("k3 1 2 ; k3 3 4", 1 + 5 + 8 + 1, 2, 2, 1.0),
        # junk sub-agents (no item; an item the task lacks) fail at once; `@`: the orchestrator searches item 1
        ("k3 ; k3 9 ; @", 1 + 1 + 1 + 14 + 1, 2, 0, 1.0),
        ("", 1, 0, 0, 0.0),  # no call: the orchestrator answers at once, with nothing
    ],
)
def test_plans_are_played_to_the_critical_steps_computed_by_hand(plan, critical, width, finished, score):
    result, m, got = play(plan)
    assert (m["critical_steps"], m["max_width"], m["finished_tasks"], got) == (critical, width, finished, score)
    assert result.status == "finished"


def test_a_plan_stands_for_the_orchestrator_tool_calls_the_sub_agents_read():
    assert env.plan_calls(TASK, "k3 1 2 ; @ ; k3 4") == [
        ("create_subagent", {"name": "w0"}),
        ("create_subagent", {"name": "w1"}),
        ("assign_task", {"agent": "w0", "task": "k3 1 2"}),
        ("assign_task", {"agent": "w1", "task": "k3 4"}),
        ("search", {"db": "k3", "item": "3"}),  # the first item no spec names
    ]
    assert env.specs(" ; k3 1 ; ; @ ") == [["k3", "1"], ["@"]]
    assert env.Task.parse(TASK.prompt) == TASK
    with pytest.raises(ValueError, match="not a task prompt"):
        env.Task.parse("db k3 find 99")


def test_parl_rewards_score_width_finishing_and_the_answer_of_played_plans():
    rewards = ParlRewards(
        rollout=env.rollout, perf_fn=lambda answer, task: env.score(answer, task), lambda1=1, lambda2=1
    )
    plans = [ONE_EACH, "k3 ; k3 9 ; @", "k3 1 2 3 ; k3 4 5 ; k3 6 7 ; k3 8", "@"]
    prompts, tasks = [TASK.prompt] * 4, [TASK.prompt] * 4
    assert rewards.r_parallel(prompts, plans, task=tasks) == [1.0, 0.5, 1.0, 0.0]  # width / 4, capped at 1
    assert rewards.r_finish(prompts, plans, task=tasks) == [1.0, 0.0, 0.75, 0.0]
    assert rewards.r_perf(prompts, plans, task=tasks) == [1.0, 1.0, 5 / 8, 1.0]


def test_episode_metrics_count_a_speed_up_only_on_solved_tasks():
    episodes = parl.Episodes()
    m = episodes.summary([TASK.prompt] * 2, [ONE_EACH, "k3 ; k3 9 ; @"])
    assert m["success"] == 1.0 and m["width"] == 5.0 and m["serial"] == 0.0
    assert m["finished"] == 8 / 10 and m["critical"] == (5 + 18) / 2 and m["ratio"] == (17 + 17) / (5 + 18)
    m = episodes.summary([TASK.prompt], ["k3 1 2 3 4 5 6 7 8"])  # one sub-agent, too much work: nothing solved
    assert m["success"] == 0.0 and m["finished"] == 0.0 and math.isnan(m["ratio"])
    assert math.isnan(episodes.summary([TASK.prompt], ["@"])["finished"])  # no sub-agent run: no fraction


def test_warm_start_traces_are_serial_or_fan_outs_of_every_item_in_order():
    import random

    rng = random.Random(0)
    plans = [env.sft_example(TASK, rng) for _ in range(200)]
    assert 60 < plans.count("@") < 140
    for plan in plans:
        if plan != "@":
            groups = env.specs(plan)
            assert all(g[0] == "k3" and len(g) > 1 for g in groups)
            assert [w for g in groups for w in g[1:]] == list(TASK.items)


# ---- the script -------------------------------------------------------------------------------------------------


def test_quick_run_prints_one_row_per_arm_and_writes_results(tmp_path):
    out = run("--quick", "--out", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr[-3000:]
    tables = markdown_tables(out.stdout)
    assert [header for header, _ in tables] == HEADERS, out.stdout
    (_, final), (_, curves), (_, claims) = tables

    assert [row[0] for row in final] == ["serial agent (scripted)", "warm start (SFT)", *ARMS]
    for row in final[1:]:
        success, width, serial, finished, critical = (seeds_mean(c) for c in row[1:6])
        assert 0 <= success <= 1 and 0 <= width <= env.MAX_SUBAGENTS and 0 <= serial <= 1
        assert finished is None or 0 <= finished <= 1
        assert 1 <= critical <= env.BUDGET
        assert seeds_mean(row[6], "x") is None or seeds_mean(row[6], "x") > 0

    assert [row[:2] for row in curves] == [[arm, step] for arm in ARMS for step in ("1", "2")]
    for row in curves:
        assert all(c == "-" or re.fullmatch(NUMBER, c) for c in row[2:]), row

    assert [row[0] for row in claims] == [
        "without r_parallel: serial collapse",
        "without r_finish: spurious parallelism",
        "with both: 3x-4.5x fewer critical steps",
    ]
    assert all(row[3] in ("yes", "no") for row in claims)
    assert "nan" not in out.stdout  # a fraction of no runs reads "-"

    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["claim"] == "parl" and results["quick"] and results["seeds"] == [0]
    assert sorted(results["arms"]) == sorted(ARMS) and results["budget"] == env.BUDGET  # written with sorted keys
    assert set(results["summary"]) == {"warm start", *ARMS}
    assert results["summary"]["full PARL"]["success"]["n"] == 1
    (seed,) = results["per_seed"]
    for arm in ARMS:
        assert [e["step"] for e in seed["arms"][arm]["curve"]] == [1, 2]
        assert set(seed["arms"][arm]["final"]) == set(parl.METRICS)
    assert [c["reproduced"] for c in results["claims"]] == [row[3] for row in claims]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib not installed: no plot" in out.stdout
    else:
        assert (tmp_path / "out" / "parl.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args, message",
    [(["--budget", "3"], "--budget must be >= 5"), (["--seeds", "-1"], "--seeds must be >= 0"), (["--bogus"], "")],
)
def test_bad_arguments_give_a_one_line_usage_error(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        parl.main([*args, "--quick"])
    assert exit.value.code == 2
    out = capsys.readouterr()
    error = [line for line in out.err.splitlines() if "error:" in line]
    assert out.out == "" and len(error) == 1 and message in error[0], out.err
