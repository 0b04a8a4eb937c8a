"""Multi-turn rollouts with tools and environments (rollout.multi_turn; docs/rollout.md, "Multi-turn
rollouts and tools").

  parsers.py       the model's text -> a tool call (Hermes / Qwen `<tool_call>{json}</tool_call>`, pluggable)
  tools.py         typed Python functions as tools, their JSON schema from signature and docstring
  environment.py   reset / step per trajectory (gym style); ToolEnvironment runs the tools
  code_tool.py     the sandboxed Python tool (_code_runner.py: namespaces, rlimits, a pids cgroup)
  trajectory.py    one trajectory's tokens, model and inserted, and the rollout Batch built from many
  loop.py          AgentLoop: generate, call, insert, continue, over any GenerationEngine
  answers.py       a call's answer as tokens, and its flat form for the ranks of a generation TP group
  registry.py      tools and environments given as Python objects (hybridflow.Run), sent to workers by value
"""

from __future__ import annotations

from hybridflow.agent.code_tool import code_tool
from hybridflow.agent.environment import Environment, StepResult, ToolEnvironment
from hybridflow.agent.loop import AgentLimits, AgentLoop
from hybridflow.agent.parsers import ToolCall, build_parser, parse_hermes
from hybridflow.agent.registry import is_registered, lookup
from hybridflow.agent.tools import Tool, load_object, load_tools
from hybridflow.config.agent import CODE_TOOL, MultiTurnConfig

__all__ = [
    "AgentLimits", "AgentLoop", "Environment", "StepResult", "Tool", "ToolCall", "ToolEnvironment",
    "build_agent_loop", "build_parser", "build_tools", "parse_hermes", "tool_schemas",
]  # fmt: skip


def build_tools(cfg: MultiTurnConfig) -> dict[str, Tool]:
    """The configured tools by name: `python` is the sandboxed code tool, `api:<name>` one given to
    hybridflow.Run (agent/registry.py), the rest `file.py:function`s."""
    key = "rollout.multi_turn.tools"
    specs = [lookup(s, key) if is_registered(s) else s for s in cfg.tools if s != CODE_TOOL]
    tools = load_tools(specs)
    if CODE_TOOL in cfg.tools:
        tools[CODE_TOOL] = code_tool(cfg.sandbox, cfg.tool_timeout_s)
    return tools


def tool_schemas(cfg: MultiTurnConfig) -> list[dict] | None:
    """The tools' JSON schemas for the chat template (`tools=`), or None: multi-turn off, or an
    environment (whose calls the template cannot know). Imports the tools' files in the driver."""
    if not cfg.enable or cfg.environment:
        return None
    return [t.schema for t in build_tools(cfg).values()]


def build_agent_loop(cfg: MultiTurnConfig, tokenizer) -> AgentLoop | None:
    """The rollout's agent loop, or None when multi-turn rollouts are off."""
    if not cfg.enable:
        return None
    key = "rollout.multi_turn.environment"
    if is_registered(cfg.environment):
        make_env = lookup(cfg.environment, key)
    elif cfg.environment:
        make_env = load_object(cfg.environment, key)
    else:
        tools = build_tools(cfg)
        make_env = lambda: ToolEnvironment(tools)  # noqa: E731
    limits = AgentLimits(cfg.max_turns, cfg.tool_timeout_s, cfg.max_tool_output_tokens, cfg.max_parallel_calls,
                         cfg.tool_response_template)  # fmt: skip
    return AgentLoop(tokenizer, build_parser(cfg.parser), make_env, limits)
