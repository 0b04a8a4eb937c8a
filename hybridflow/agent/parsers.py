"""Tool-call parsers: the text of one model turn -> the tool call it ends with, if any.

A parser reads the decoded text of the tokens generated in one turn and returns the first complete call
and where its text ends, so the loop keeps the generated tokens up to that point (never re-tokenizes
them). Built in: `hermes`, the Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
format. Any other format is a `file.py:function` (or a Python callable) with the same signature as
`parse_hermes`.

A parser may name the characters its calls' text ends with in an `end_chars` attribute (Hermes: ">",
of `</tool_call>`): the agent loop, which looks for a call after every token sampled, then parses only
after tokens whose text holds one of them (each token id's text is decoded once), not the whole turn's
text at every token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for. `error` is set (and name may be empty) when the call's text is
    there but malformed: the loop answers it with the error instead of running a tool."""

    name: str
    arguments: dict = field(default_factory=dict)
    end: int = 0
    """Characters of the turn's text up to and including the call's closing marker."""
    error: str = ""


Parser = Callable[[str], "ToolCall | None"]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_hermes(text: str) -> ToolCall | None:
    """The first `<tool_call>{json}</tool_call>` in `text`, or None when there is no complete one."""
    match = _HERMES.search(text)
    if match is None:
        return None
    end = match.end()
    try:
        body = json.loads(match.group(1))
    except json.JSONDecodeError as e:
        return ToolCall("", {}, end, f"tool call is not JSON: {e.msg} at column {e.colno}")
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return ToolCall("", {}, end, 'tool call needs {"name": str, "arguments": {...}}')
    args = body.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(body["name"], {}, end, "tool call arguments are not JSON")
    if not isinstance(args, dict):
        return ToolCall(body["name"], {}, end, "tool call arguments must be a JSON object")
    return ToolCall(body["name"], args, end)


parse_hermes.end_chars = ">"  # type: ignore[attr-defined]

PARSERS: dict[str, Parser] = {"hermes": parse_hermes}


def build_parser(spec: str | Parser) -> Parser:
    """A built-in parser's name, a `file.py:function`, or a callable."""
    if callable(spec):
        return spec
    if spec in PARSERS:
        return PARSERS[spec]
    from hybridflow.agent.tools import load_object

    return load_object(spec, "rollout.multi_turn.parser")
