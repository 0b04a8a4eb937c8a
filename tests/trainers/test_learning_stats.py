"""The learning tests' statistics against hand-computed values."""

from __future__ import annotations

import json
import math

import pytest

from tests.trainers.learning_stats import paired_gain, run_gain


def test_paired_gain_by_hand():
    before = {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0}
    afters = [{"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0}, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0}]
    gain, se = paired_gain(before, afters)
    # d = [1, 0.5, 0, 0.5]: mean 0.5; sample variance (0.25 + 0 + 0.25 + 0) / 3; se = sqrt(var / 4)
    assert gain == pytest.approx(0.5)
    assert se == pytest.approx(math.sqrt((0.5 / 3) / 4))


def test_paired_gain_needs_the_same_problems():
    with pytest.raises(ValueError, match="different problems"):
        paired_gain({"a": 0.0, "b": 1.0}, [{"a": 1.0, "c": 1.0}])


def test_run_gain_reads_the_first_and_last_validations(tmp_path):
    rows = [(0, "1+1=", 0.0), (0, "2+2=", 1.0), (10, "1+1=", 0.0), (10, "2+2=", 0.0),
            (20, "1+1=", 1.0), (20, "2+2=", 1.0), (30, "1+1=", 1.0), (30, "2+2=", 0.0)]  # fmt: skip
    lines = [json.dumps({"step": s, "prompt_text": p, "score": x}) for s, p, x in rows]
    (tmp_path / "generations.jsonl").write_text("\n".join(lines) + "\n")
    before, after, gain, se = run_gain(tmp_path, late=2)  # steps 20 and 30
    # per problem: 1+1= 0 -> (1 + 1) / 2 = 1; 2+2= 1 -> (1 + 0) / 2 = 0.5; d = [1, -0.5]
    assert (before, gain) == (0.5, pytest.approx(0.25))
    assert after == pytest.approx(0.75)
    assert se == pytest.approx(math.sqrt(((0.75**2) * 2 / 1) / 2))
