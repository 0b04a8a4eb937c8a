"""Exact-match reward for the synthetic arithmetic task (hybridflow/data/synthetic.py, "a+b=" -> "c").

The SFT target is the bare answer, so the default is strict: the whole response, stripped of
surrounding whitespace, must equal the gold answer (an answer followed by junk scores 0, which is
exactly the behaviour RL should remove). mode="first_number" accepts the first number in the response,
for prompts that let the model talk before answering.
"""

from __future__ import annotations

import re

__all__ = ["compute_score"]

_INT = re.compile(r"-?\d+")


def compute_score(solution_str: str, ground_truth: str, mode: str = "exact") -> float:
    """1.0 if the response's answer equals ground_truth, else 0.0. mode: "exact" | "first_number"."""
    gold = str(ground_truth).strip()
    if mode == "exact":
        return 1.0 if solution_str.strip() == gold else 0.0
    if mode == "first_number":
        m = _INT.search(solution_str)
        return 1.0 if m is not None and m.group(0) == gold else 0.0
    raise ValueError(f"unknown arithmetic reward mode {mode!r}; choose 'exact' or 'first_number'")
