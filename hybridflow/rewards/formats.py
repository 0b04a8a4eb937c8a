"""Format rewards: does the response follow the requested layout (regardless of correctness)?

Used alone (to teach a layout early) or added to a correctness reward. Named formats cover the
common cases; any other layout is a regular expression that must match the whole response.
"""

from __future__ import annotations

import re

__all__ = ["FORMATS", "format_reward"]

FORMATS: dict[str, str] = {
    # DeepSeek-R1 style: reasoning in <think>, the answer in <answer>.
    "think_answer": r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*",
    # Ends with a GSM8K answer marker.
    "gsm8k": r".*#### *-?[$0-9.,]*[0-9]\s*",
    # Contains a \boxed{...} answer.
    "boxed": r".*\\boxed\{.+\}.*",
}


def format_reward(solution_str: str, fmt: str = "think_answer", score: float = 1.0) -> float:
    """`score` if solution_str matches `fmt` in full, else 0.0.

    fmt: a name in FORMATS or a regular expression (matched with re.DOTALL against the whole response).
    """
    pattern = FORMATS.get(fmt, fmt)
    return score if re.fullmatch(pattern, solution_str, flags=re.DOTALL) else 0.0
