"""Pure pieces of the agent: the Hermes parser, tool schemas from typed functions, the tool environment's
answers to bad calls and slow tools, and the config checks."""

from __future__ import annotations

import time

from hybridflow.agent.environment import ToolEnvironment
from hybridflow.agent.parsers import ToolCall, build_parser, parse_hermes
from hybridflow.agent.tools import Tool
from hybridflow.config.agent import MultiTurnConfig, multi_turn_errors


def multiply(a: int, b: int, note: str | None = None) -> int:
    """Multiply two integers exactly.

    Args:
        a: the first factor
        b (int): the second factor
    """
    return a * b


def test_hermes_parser_finds_the_first_complete_call_and_where_it_ends():
    text = 'Let me compute. <tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call> then'
    call = parse_hermes(text)
    assert call == ToolCall("multiply", {"a": 12, "b": 34}, text.index(" then"))
    assert parse_hermes(text[: call.end - 1]) is None  # not complete yet
    assert parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>').arguments == {
        "x": 1
    }
    bad = parse_hermes("<tool_call>{name: f}</tool_call>")
    assert bad.error.startswith("tool call is not JSON") and bad.end == len(
        "<tool_call>{name: f}</tool_call>"
    )
    assert build_parser("hermes") is parse_hermes


def test_schema_from_signature_and_docstring():
    fn = Tool.from_function(multiply).schema["function"]
    assert fn["name"] == "multiply" and fn["description"] == "Multiply two integers exactly."
    assert fn["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "the first factor"},
            "b": {"type": "integer", "description": "the second factor"},
            "note": {"type": "string"},
        },
        "required": ["a", "b"],
    }


def test_the_environment_answers_bad_calls_and_timeouts_with_one_line():
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    env = ToolEnvironment({"multiply": Tool.from_function(multiply), "slow": Tool.from_function(slow)})
    assert env.step(ToolCall("multiply", {"a": 3, "b": 4}), 1.0).observation == "12"
    for call, expect in [
        (ToolCall("divide", {}), "no tool 'divide'"),
        (ToolCall("multiply", {"a": 3}), "missing ['b']"),
        (ToolCall("multiply", {"a": "3", "b": 4}), "'a' must be integer"),
        (ToolCall("", {}, 0, "tool call is not JSON"), "not JSON"),
    ]:
        r = env.step(call, 1.0)
        assert r.error and expect in r.observation and "\n" not in r.observation, r
    r = env.step(ToolCall("slow", {"seconds": 2.0}), 0.2)
    assert r.timed_out and "timed out after 0.2 s" in r.observation


def test_config_checks():
    assert multi_turn_errors(MultiTurnConfig()) == []
    errors = multi_turn_errors(
        MultiTurnConfig(enable=True, tool_response_template="x", parser="xml", max_turns=0)
    )
    assert [e.split(":")[0] for e in errors] == [
        "rollout.multi_turn.max_turns", "rollout.multi_turn.tool_response_template", "rollout.multi_turn.parser",
        "rollout.multi_turn.enable",
    ]  # fmt: skip


def test_the_chat_template_is_given_the_tool_schemas(tmp_path):
    """As HF templates with tool support read them (Qwen's lists each schema as JSON under # Tools)."""
    from hybridflow.agent import tool_schemas
    from hybridflow.data.prompts import render_prompt
    from hybridflow.models.tiny import build_char_tokenizer

    spec = tmp_path / "tools.py"
    spec.write_text("def add(a: int, b: int) -> int:\n    '''Add.'''\n    return a + b\n")
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}" + tok.chat_template
    )
    schemas = tool_schemas(MultiTurnConfig(enable=True, tools=[f"{spec}:add"]))
    assert render_prompt("1+2=", tok, True, schemas) == "[add]<|user|>1+2=<|assistant|>"
    assert tool_schemas(MultiTurnConfig()) is None
