"""The statistics of a learning test: the held-out accuracy gain and its standard error, paired by problem.

Each validation is greedy, one answer per held-out problem, all of them written to generations.jsonl
(`trainer.val_generations_to_log` >= the validation size). The gain compares each problem with itself:
d_i = (mean score of problem i over the late validations) - (its score before training), and
gain = mean(d), se = std(d, ddof=1) / sqrt(n). Pairing removes the between-problem variance that two
independent accuracies would carry (most problems are right, or wrong, both times), and averaging the
late validations removes part of the step-to-step swing of one validation. A test asserts
gain >= max(floor, 3 * se): a gain three standard errors clear of zero, whatever the machine's kernels.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path


def validation_scores(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> {prompt_text: score} of every validation logged in run_dir/generations.jsonl."""
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for line in (Path(run_dir) / "generations.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]][row["prompt_text"]] = float(row["score"])
    return dict(out)


def paired_gain(before: dict[str, float], afters: list[dict[str, float]]) -> tuple[float, float]:
    """(gain, standard error) of the mean over problems of mean(afters[k][p]) - before[p].

    Every validation must score the same problems (a mismatch raises: the test would compare other sets)."""
    for after in afters:
        if set(after) != set(before):
            raise ValueError(f"validations score different problems: {len(before)} vs {len(after)}")
    d = [sum(a[p] for a in afters) / len(afters) - before[p] for p in sorted(before)]
    n = len(d)
    if n < 2:
        raise ValueError("a paired gain needs at least 2 problems")
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1)
    return mean, math.sqrt(var / n)


def run_gain(run_dir: Path, late: int) -> tuple[float, float, float, float]:
    """(accuracy before, accuracy after = mean of the last `late` validations, gain, se) of one run."""
    scores = validation_scores(run_dir)
    steps = sorted(scores)
    before, afters = scores[steps[0]], [scores[s] for s in steps[-late:]]
    gain, se = paired_gain(before, afters)
    acc_before = sum(before.values()) / len(before)
    return acc_before, acc_before + gain, gain, se
