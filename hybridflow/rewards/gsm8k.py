"""GSM8K rule reward: does the response's final answer equal the gold number?

GSM8K solutions end with `#### <number>`. "strict" mode reads only that marker (what a model trained on
the GSM8K format should emit, verl's default); "flexible" mode takes the last number anywhere in the
response (useful for models prompted to answer in prose). Numbers compare by value after removing
thousands separators and currency signs, so "1,000", "$1000" and "1000.00" all match 1000.
"""

from __future__ import annotations

import re

__all__ = ["extract_solution", "normalize_number", "compute_score"]

_STRICT = re.compile(r"#### *(-?[$0-9.,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]*[0-9]")
# Only the tail is searched: the answer is at the end, and regexes over a 4k-token ramble cost time.
_TAIL_CHARS = 300


def normalize_number(text: str) -> str | None:
    """'$1,234.50' -> '1234.5'; returns None if `text` is not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return str(int(value)) if value.is_integer() else repr(value)


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer string of a response, or None when there is none.

    method: "strict" (the last `#### <number>`) or "flexible" (the last number in the text).
    """
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
    elif method == "flexible":
        found = _NUMBER.findall(tail)
    else:
        raise ValueError(f"unknown GSM8K extraction method {method!r}; choose 'strict' or 'flexible'")
    for candidate in reversed(found):
        if normalize_number(candidate) is not None:
            return candidate
    return None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals ground_truth by value, `format_score` if an answer was
    found but is wrong, 0 if none was found."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    gold = normalize_number(str(ground_truth))
    if gold is None:  # gold given as "#### 42" or a full GSM8K solution
        gold_answer = extract_solution(str(ground_truth), "strict") or extract_solution(
            str(ground_truth), "flexible"
        )
        gold = normalize_number(gold_answer) if gold_answer else None
    return score if gold is not None and normalize_number(answer) == gold else format_score
