"""The synthetic arithmetic task of the demo: "a+b=" prompts generated on the fly from a seed.

Every problem in the space (operands 0..max_operand, the given operators) is enumerated and
shuffled by the seed; the first `val_size` are the validation split and the rest the training
split, so the two never overlap and the same seed always gives the same rows. Rows are in verl's
format, so they go through the same parsing and tokenisation as files do. The SFT and DPO variants
add a target response, or a (correct, wrong) preference pair.
"""

from __future__ import annotations

import random

from hybridflow.data.registry import register_dataset

DATA_SOURCE = "synthetic:arithmetic"
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _problems(seed: int, max_operand: int, ops: str) -> list[tuple[int, str, int]]:
    bad = [op for op in ops if op not in _OPS]
    if bad:
        raise ValueError(f"synthetic:arithmetic: unknown operators {bad}; use some of {''.join(_OPS)}")
    problems = [
        (a, op, b)
        for op in ops
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
        if op != "-" or a >= b  # keep answers non-negative
    ]
    random.Random(seed).shuffle(problems)
    return problems


def _split(split: str, seed: int, num_samples: int, val_size: int, max_operand: int, ops: str):
    problems = _problems(seed, max_operand, ops)
    if val_size >= len(problems):
        raise ValueError(
            f"synthetic:arithmetic: val_size {val_size} leaves no training problems out of {len(problems)}; "
            "lower val_size or raise max_operand"
        )
    if split in ("val", "validation", "test"):
        return problems[:val_size]
    train = problems[val_size:]
    if num_samples <= 0:
        return train
    # cycle through the training problems (each pass in a seeded order) up to num_samples rows
    out, rng = [], random.Random(seed + 1)
    while len(out) < num_samples:
        out.extend(rng.sample(train, len(train)))
    return out[:num_samples]


def _row(i: int, split: str, a: int, op: str, b: int) -> dict:
    answer = _OPS[op](a, b)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}{op}{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": i},
    }


@register_dataset("synthetic:arithmetic")
def arithmetic(
    split: str = "train",
    seed: int = 0,
    num_samples: int = 1000,
    val_size: int = 32,
    max_operand: int = 9,
    ops: str = "+",
) -> list[dict]:
    """Prompt rows "a+b=" with the answer as ground truth (val split: `val_size` held-out problems)."""
    return [
        _row(i, split, *p) for i, p in enumerate(_split(split, seed, num_samples, val_size, max_operand, ops))
    ]


@register_dataset("synthetic:arithmetic_sft")
def arithmetic_sft(split: str = "train", seed: int = 0, **kwargs) -> list[dict]:
    """The same rows with `response` = the correct answer (for the SFT warm start)."""
    rows = arithmetic(split, seed, **kwargs)
    for row in rows:
        row["response"] = row["reward_model"]["ground_truth"]
    return rows


@register_dataset("synthetic:arithmetic_dpo")
def arithmetic_dpo(split: str = "train", seed: int = 0, **kwargs) -> list[dict]:
    """The same rows with `chosen` = the correct answer and `rejected` = a nearby wrong one."""
    rows = arithmetic(split, seed, **kwargs)
    rng = random.Random(seed + 2)
    for row in rows:
        answer = int(row["reward_model"]["ground_truth"])
        wrong = answer + rng.choice([-2, -1, 1, 2])
        row["chosen"], row["rejected"] = str(answer), str(wrong if wrong >= 0 else answer + 1)
    return rows
