"""Agent swarms (Kimi K2.5, arXiv 2602.02276): an asyncio orchestrator runtime with parallel sub-agents, a JSONL trace with
critical-step metrics, and PARL rewards for TRL's GRPOTrainer."""

from .backends import Backend, BackendError, Completion, OpenAIBackend, ScriptedBackend, TransformersBackend
from .rewards import ParlRewards, SwarmRollout, annealed, r_finish, r_parallel
from .runtime import Swarm, SwarmConfig, SwarmResult, arun_single_agent, run_single_agent
from .tools import ORCHESTRATOR_TOOLS, Tool, ToolCall, as_tools, format_tool_calls, parse_tool_calls
from .trace import Trace, swarm_metrics


__all__ = [
    "Backend",
    "BackendError",
    "Completion",
    "OpenAIBackend",
    "ScriptedBackend",
    "TransformersBackend",
    "ParlRewards",
    "SwarmRollout",
    "annealed",
    "r_finish",
    "r_parallel",
    "Swarm",
    "SwarmConfig",
    "SwarmResult",
    "arun_single_agent",
    "run_single_agent",
    "ORCHESTRATOR_TOOLS",
    "Tool",
    "ToolCall",
    "as_tools",
    "format_tool_calls",
    "parse_tool_calls",
    "Trace",
    "swarm_metrics",
]
