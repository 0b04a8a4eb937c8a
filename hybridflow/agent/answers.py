"""A tool call's answer as a trajectory takes it, and its flat form for the ranks of a generation
tensor-parallel group: the group's first rank runs the calls and hands every rank the same answers
(rollout/continuous.py, `ContinuousBatch.share`), as one list of floats (float64 on the wire: token ids,
row numbers and flags are exact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_HEAD = 7  # row, token count, done, error, timed_out, reward (NaN: none), seconds


@dataclass(frozen=True)
class Answer:
    """Row `row`'s call answered: the observation's tokens (already cut to max_tool_output_tokens) and
    the StepResult's flags, reward and the call's seconds."""

    row: int
    tokens: list[int]
    done: bool = False
    error: bool = False
    timed_out: bool = False
    reward: float | None = None
    seconds: float = 0.0


def pack(answers: list[Answer]) -> list[float]:
    """Answers -> one flat list: per answer its head (_HEAD numbers), then its tokens."""
    out: list[float] = []
    for a in answers:
        reward = math.nan if a.reward is None else a.reward
        out += [a.row, len(a.tokens), a.done, a.error, a.timed_out, reward, a.seconds, *a.tokens]
    return out


def unpack(values: list[float]) -> list[Answer]:
    """The inverse of `pack`."""
    answers, at = [], 0
    while at < len(values):
        row, k, done, error, timed_out, reward, seconds = values[at : at + _HEAD]
        tokens = [int(t) for t in values[at + _HEAD : at + _HEAD + int(k)]]
        reward = None if math.isnan(reward) else reward
        answers.append(Answer(int(row), tokens, bool(done), bool(error), bool(timed_out), reward, seconds))
        at += _HEAD + int(k)
    return answers
