"""Environments: what answers the model's tool calls, one instance per trajectory (gym style).

`reset(row)` is called once before the first turn with the prompt row's non-tensor fields (ground truth,
extra info, ...); `step(call)` answers one parsed call with an observation (text inserted as tokens),
whether the episode is over, and optionally a reward. `ToolEnvironment`, the default, runs the configured
tools. A user environment is a class named by `file.py:Class` (rollout.multi_turn.environment) built
with no arguments, or any factory callable from Python.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass

from hybridflow.agent.parsers import ToolCall
from hybridflow.agent.tools import Tool, ToolTimeout

TIMEOUT_GRACE_S = 5.0  # how long past the timeout a tool that stops itself gets to say so


@dataclass
class StepResult:
    observation: str
    done: bool = False
    reward: float | None = None
    error: bool = False
    """The call failed (malformed, unknown tool, bad arguments, the tool raised): counted as a tool error."""
    timed_out: bool = False


class Environment:
    """Override `step`; `reset` and `close` are optional."""

    def reset(self, row: dict) -> None:
        pass

    def step(self, call: ToolCall, timeout_s: float) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ToolEnvironment(Environment):
    """Answers each call by running the named tool. A tool is in-process Python: past `timeout_s` the
    model is answered with a timeout and the loop moves on; the function's thread is not killed (Python
    threads cannot be), so a tool that may hang belongs in a subprocess (agent/code_tool.py kills its
    process on timeout)."""

    def __init__(self, tools: dict[str, Tool]):
        self.tools = tools

    def step(self, call: ToolCall, timeout_s: float) -> StepResult:
        if call.error:
            return StepResult(f"error: {call.error}", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return StepResult(f"error: no tool {call.name!r}; tools: {sorted(self.tools)}", error=True)
        bad = tool.check_arguments(call.arguments)
        if bad:
            return StepResult(f"error: {bad}", error=True)
        pool = cf.ThreadPoolExecutor(1)
        future = pool.submit(tool.fn, **call.arguments)
        try:
            return StepResult(str(future.result(timeout=timeout_s + tool.kills_on_timeout * TIMEOUT_GRACE_S)))
        except ToolTimeout as e:
            return StepResult(str(e), error=True, timed_out=True)
        except cf.TimeoutError:
            return StepResult(
                f"error: {call.name} timed out after {timeout_s:g} s", error=True, timed_out=True
            )
        except Exception as e:  # the tool's own failure is the model's observation, not the run's
            return StepResult(f"error: {type(e).__name__}: {e}", error=True)
        finally:
            pool.shutdown(wait=False)


def timed_step(env: Environment, call: ToolCall, timeout_s: float) -> tuple[StepResult, float]:
    start = time.perf_counter()
    result = env.step(call, timeout_s)
    return result, time.perf_counter() - start
