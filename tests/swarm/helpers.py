"""Scripted agents for the swarm tests."""

from kimi_hf.swarm import format_tool_calls


def tool_results(messages):
    return [m["content"] for m in messages if m["role"] == "tool"]


def fan_out_orchestrator(n_agents, tasks_per_turn=None, turns=1, markup="kimi"):
    """Creates n agents, then assigns each a task per turn for `turns` turns, then answers with the results
    (tool calls written in `markup`: Kimi K2's or "k3")."""

    def policy(messages, tools):
        done = sum(1 for m in messages if m["role"] == "assistant")
        if done < turns:
            calls = [("create_subagent", {"name": f"a{i}"}) for i in range(n_agents)] if done == 0 else []
            calls += [("assign_task", {"agent": f"a{i}", "task": f"item {i} turn {done}"}) for i in range(n_agents)]
            return format_tool_calls(calls, markup=markup)
        return " | ".join(r for r in tool_results(messages) if not r.startswith("Created"))

    return policy


def worker(steps=1, fail_on=None, markup="kimi"):
    """A sub-agent that calls `lookup` (steps - 1) times, then answers with the last result; raises on `fail_on`."""

    def policy(messages, tools):
        task = messages[1]["content"]
        if fail_on and fail_on in task:
            raise RuntimeError(f"boom on {task}")
        used = sum(1 for m in messages if m["role"] == "tool")
        if used < steps - 1:
            return format_tool_calls([("lookup", {"key": task})], markup=markup)
        return f"done: {task}"

    return policy


def lookup(key: str) -> str:
    """Looks a key up.

    Args:
        key: what to look up.
    """
    return f"value of {key}"
