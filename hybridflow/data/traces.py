"""SFT targets that are tool-use traces: model turns and tool outputs, tokenized as the agent loop lays
them out, with a loss mask of 1 on the model's tokens only.

A trace is either text holding the tool outputs already wrapped in rollout.multi_turn's
tool_response_template (`<c>12*34</c><r>408</r>408` with `<r>{output}</r>`), or a message list of
`assistant` turns and `tool` outputs. Each model turn is tokenized on its own; each tool output becomes
tokens(before) + tokens(output)[:max_output_tokens] + tokens(after), the template's text around
`{output}`, as agent/loop.py inserts it: so the warm start is trained on the token layout its rollouts
will have, and the loss (response_mask) counts the model's tokens, never the tool's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolOutputs:
    """How tool outputs are inserted (rollout.multi_turn's tool_response_template and
    max_tool_output_tokens)."""

    template: str
    max_output_tokens: int

    @property
    def around(self) -> tuple[str, str]:
        before, _, after = self.template.partition("{output}")
        return before, after


Segment = tuple[str, bool]
"""(text, is the model's): a model turn, or a tool's output (without the template's text)."""


def trace_segments(value: Any, tools: ToolOutputs | None) -> list[Segment] | None:
    """A response column's trace as segments; None when it holds no tool output (an ordinary
    response). ValueError (a malformed row) for a message list that is not assistant / tool turns."""
    if isinstance(value, list) and any(isinstance(m, dict) and m.get("role") == "tool" for m in value):
        if tools is None:
            raise ValueError("the response holds tool messages; set rollout.multi_turn.enable to insert them")
        return [_message_segment(m) for m in value]
    if isinstance(value, str) and tools is not None:
        before, after = tools.around
        if not before or not after:  # no markers to find the outputs by: the text is the model's
            return None
        parts = re.split(f"{re.escape(before)}(.*?){re.escape(after)}", value, flags=re.S)
        if len(parts) == 1:
            return None
        # re.split alternates text between matches (the model's) and the captured outputs (the tool's)
        return [(part, i % 2 == 0) for i, part in enumerate(parts) if part or i % 2]
    return None


def _message_segment(m: Any) -> Segment:
    role = m.get("role") if isinstance(m, dict) else None
    content = m.get("content") if isinstance(m, dict) else None
    if role not in ("assistant", "tool") or not isinstance(content, str):
        raise ValueError(f"a trace's messages are assistant or tool turns with text content, got {m!r}")
    return content, role == "assistant"


def tokenize_trace(segments: list[Segment], tokenizer, tools: ToolOutputs) -> tuple[list[int], list[int]]:
    """-> (token ids, loss mask): 1 on model tokens, 0 on the inserted ones."""
    before, after = (_encode(tokenizer, t) for t in tools.around)
    ids: list[int] = []
    mask: list[int] = []
    for text, is_model in segments:
        if is_model:
            tokens = _encode(tokenizer, text)
        else:
            tokens = before + _encode(tokenizer, text)[: tools.max_output_tokens] + after
        ids += tokens
        mask += [int(is_model)] * len(tokens)
    return ids, mask


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []
