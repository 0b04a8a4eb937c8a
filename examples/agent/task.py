"""The agent demo's task: multiply two 2-digit numbers, with a calculator tool.

The tiny char-level model cannot multiply by itself; with the tool it only has to copy the operands
into a call and the tool's answer out of the response. Its character set has no braces, so the call
is `<c>12*34</c>` (a parser of its own, `parse_calc`: any format plugs in as this one does) and the
tool's output comes back as `<r>408</r>` (rollout.multi_turn.tool_response_template). A full trace:

    prompt  <|user|>12*34=<|assistant|>
    model   <c>12*34</c>          tool  <r>408</r>          model  408<eos>

`rows` writes the prompts (verl format) and the SFT traces; `compute_score` scores the text after the
last tool output; `calc` is the tool, a typed function whose schema comes from its signature.
"""

from __future__ import annotations

import random
import re

from hybridflow.agent import ToolCall

DATA_SOURCE = "agent:multiply"
_CALL = re.compile(r"<c>(.*?)</c>", re.S)


def calc(expression: str) -> str:
    """Evaluate `a*b`, `a+b` or `a-b` on integers.

    Args:
        expression: two integers and one operator, e.g. 12*34
    """
    m = re.fullmatch(r"\s*(\d{1,6})\s*([*+-])\s*(\d{1,6})\s*", expression)
    if m is None:
        raise ValueError(f"cannot evaluate {expression!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str({"*": a * b, "+": a + b, "-": a - b}[op])


def parse_calc(text: str) -> ToolCall | None:
    """The first complete `<c>...</c>` in a turn's text."""
    m = _CALL.search(text)
    return None if m is None else ToolCall("calc", {"expression": m.group(1)}, m.end())


def final_answer(solution: str) -> str:
    """The model's answer: what follows the last tool output (the whole text when there was none)."""
    return solution.rsplit("</r>", 1)[-1].strip()


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(final_answer(solution_str) == str(ground_truth))


def problems(seed: int = 0, low: int = 10, high: int = 99) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs


def rows(pairs: list[tuple[int, int]], split: str, traces: bool = False) -> list[dict]:
    """verl-format rows; with `traces`, a `response` holding the whole tool-use trace (SFT)."""
    out = []
    for i, (a, b) in enumerate(pairs):
        row = {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": i},
        }
        if traces:
            row["response"] = f"<c>{a}*{b}</c><r>{a * b}</r>{a * b}"
        out.append(row)
    return out
