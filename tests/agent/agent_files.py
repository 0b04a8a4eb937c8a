"""A tool and a parser given to `hybridflow train` by file path (rollout.multi_turn.tools / .parser), as a
user's would be. The parser calls `echo` at the first digit a turn produces: a random tiny model emits
digits often, so its trajectories hold several turns."""

from __future__ import annotations

from hybridflow.agent import ToolCall


def digit_parser(text: str) -> ToolCall | None:
    for j, ch in enumerate(text):
        if ch.isdigit():
            return ToolCall("echo", {"digit": int(ch)}, j + 1)
    return None


def echo(digit: int) -> str:
    """Repeat a digit.

    Args:
        digit: the digit
    """
    return f"got {digit}"
