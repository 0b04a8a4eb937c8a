"""`rollout.multi_turn`: multi-turn rollouts with tools or an environment (hybridflow/agent/ runs them;
docs/rollout.md, "Multi-turn rollouts and tools"). Importable without torch or Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hybridflow.config.sandbox import SandboxConfig
from hybridflow.fields import MAX_SECONDS, domain_errors, section, setting

PARSERS = ("hermes",)
CODE_TOOL = "python"
"""The built-in tool name of the sandboxed code interpreter (agent/code_tool.py)."""


@dataclass
class MultiTurnConfig:
    """Generate, call a tool, insert its output as tokens, continue: token in, token out."""

    enable: bool = setting(False, "multi-turn rollouts: the response holds model turns and tool outputs")
    max_turns: int = setting(4, "most model turns per trajectory (a call in the last one is not run)", ge=1)
    tools: list = setting(
        [], f"tools the model may call: 'path/file.py:function' (typed Python functions), or {CODE_TOOL!r} "
        "(the sandboxed code interpreter)",
    )  # fmt: skip
    environment: str = setting(
        "", "'path/file.py:Class' with reset(row)/step(call, timeout_s), one per trajectory; '' = the tools"
    )
    parser: str = setting(
        "hermes", "tool-call format: hermes (<tool_call>{json}</tool_call>) or 'file.py:function'"
    )
    tool_response_template: str = setting(
        "<tool_response>{output}</tool_response>",
        "text around a tool's output, inserted as tokens after the call ({output} is replaced; Qwen's chat "
        "format wants '<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>"
        "\\n<|im_start|>assistant\\n')",
    )  # fmt: skip
    tool_timeout_s: float = setting(
        10.0,
        "seconds one tool call may take; then the model is answered with a timeout",
        gt=0,
        le=MAX_SECONDS,
    )
    max_tool_output_tokens: int = setting(
        256, "a tool's output is cut to this many tokens (the template's not counted)", ge=1
    )
    max_parallel_calls: int = setting(
        8, "tool calls run at once per rollout rank (threads; the code tool's are processes)", ge=1
    )
    sandbox: SandboxConfig = section(
        SandboxConfig, "limits of the code tool's processes", memory_mb=1024, cpu_s=10.0
    )


def multi_turn_errors(m: MultiTurnConfig, engine_n: int = 1) -> list[str]:
    """The problems of `rollout.multi_turn`, one message each, starting with the key."""
    key = "rollout.multi_turn"
    errors = domain_errors(m, key + ".")  # the whole tree's are checked first; here for direct callers
    if "{output}" not in m.tool_response_template:
        errors.append(
            f"{key}.tool_response_template: must contain {{output}}, got {m.tool_response_template!r}"
        )
    if m.parser not in PARSERS and ":" not in m.parser:
        errors.append(f"{key}.parser: {m.parser!r} is neither one of {PARSERS} nor 'path/file.py:function'")
    for spec in m.tools:
        if spec != CODE_TOOL and ":" not in str(spec):
            errors.append(f"{key}.tools: {spec!r} is neither {CODE_TOOL!r} nor 'path/file.py:function'")
    for name, spec in [("tools", s) for s in m.tools] + [
        ("environment", m.environment),
        ("parser", m.parser),
    ]:
        target = str(spec).rpartition(":")[0]
        if target.endswith(".py") and not os.path.isfile(os.path.expanduser(target)):
            errors.append(
                f"{key}.{name}: the file {os.path.abspath(os.path.expanduser(target))} does not exist"
            )
    if m.enable and not m.tools and not m.environment:
        errors.append(f"{key}.enable: true needs rollout.multi_turn.tools or rollout.multi_turn.environment")
    if not m.enable and (m.tools or m.environment):
        errors.append(f"{key}.tools/environment: set, but rollout.multi_turn.enable is false (set it true)")
    return errors


def absolute_specs(m: MultiTurnConfig) -> None:
    """'rel/file.py:name' -> '/abs/rel/file.py:name' in place, for tools, environment and parser."""

    def absolute(spec: str) -> str:
        target, sep, name = str(spec).rpartition(":")
        if target.endswith(".py"):
            return f"{os.path.abspath(os.path.expanduser(target))}{sep}{name}"
        return spec

    m.tools = [absolute(s) for s in m.tools]
    m.environment, m.parser = absolute(m.environment), absolute(m.parser)
