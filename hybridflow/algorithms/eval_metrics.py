"""Validation metrics over n samples per prompt, as pure functions (numbers in, numbers out).

acc@1 (the first sample), mean@n and best@n are plain means; here are the two that need care:
- pass@k for k < n: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models
  Trained on Code"): with c of n samples correct, pass@k = 1 - C(n-c, k) / C(n, k), the chance that k
  samples drawn without replacement from the n contain a correct one. Averaged over prompts. (Taking
  the first k samples instead would be unbiased too but has a higher variance.)
- maj@n: majority voting (self-consistency): the answer most samples give, scored by whether it is right.
Used by Trainer.validate (trainers/base.py); docs/metrics.md lists the names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct of n samples (1 <= k <= n)."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k)/C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials
    prob_none = 1.0
    for i in range(n - c + 1, n + 1):
        prob_none *= 1.0 - k / i
    return 1.0 - prob_none


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; correct[p] holds prompt p's n sample outcomes."""
    return sum(pass_at_k(len(c), sum(map(bool, c)), k) for c in correct) / len(correct)


def majority_correct(answers: Sequence[Hashable], correct: Sequence[bool]) -> bool:
    """Is the most common answer right? Ties go to the answer seen first; its first sample decides."""
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return bool(correct[list(answers).index(winner)])


def maj_at_n(answers: Sequence[Sequence[Hashable]], correct: Sequence[Sequence[bool]]) -> float:
    """maj@n over prompts: answers[p] / correct[p] are prompt p's n samples."""
    return sum(majority_correct(a, c) for a, c in zip(answers, correct, strict=True)) / len(answers)


def pass_ks(n: int) -> list[int]:
    """The k < n to report for n samples: powers of two from 2 (pass@1 is mean@n, pass@n is best@n)."""
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return out


def vote_metrics(prefix: str, votes: list[tuple[list, list[bool]]], n: int) -> dict[str, float]:
    """{prefix}/maj@n and {prefix}/pass@k (k in pass_ks(n)) from each prompt's (answers, correct)."""
    if not votes:
        return {}
    answers, correct = [a for a, _ in votes], [c for _, c in votes]
    out = {f"{prefix}/maj@{n}": maj_at_n(answers, correct)}
    out.update({f"{prefix}/pass@{k}": mean_pass_at_k(correct, k) for k in pass_ks(n)})
    return out
