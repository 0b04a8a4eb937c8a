"""The reward of `reasoning_gym:<task>` rows (hybridflow/data/reasoning_tasks.py): reasoning-gym's own
verifier for the task, `score_answer(answer, entry)`, a score in [0, 1].

The answer is the text inside the response's last <answer>...</answer> (what reasoning-gym's default
system prompt asks for), else the whole response stripped. The entry is rebuilt from the row's
extra_info (task, seed, size, config, index), as the dataset generated it; datasets are cached per
process. Returns {"score", "acc"}: acc is a full score, so validation's acc@1 counts right answers
even for tasks whose verifier gives partial credit.
"""

from __future__ import annotations

import functools
import importlib
import json
import re

PREFIX = "reasoning_gym:"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


@functools.lru_cache(maxsize=64)
def _dataset(task: str, seed: int, size: int, config_json: str):
    reasoning_gym = importlib.import_module("reasoning_gym")
    return reasoning_gym.create_dataset(task, seed=seed, size=size, **json.loads(config_json))


def extract_answer(response: str) -> str:
    """The last <answer>...</answer>'s text, else the response, stripped."""
    found = _ANSWER.findall(response)
    return (found[-1] if found else response).strip()


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """Per-sample reward (verl's convention) of a reasoning_gym row."""
    where = (extra_info or {}).get("reasoning_gym")
    if not isinstance(where, dict):
        raise ValueError(
            f"data_source {data_source!r}: the row's extra_info has no 'reasoning_gym' entry "
            "(rows of data.dataset=reasoning_gym:<task> carry it)"
        )
    dataset = _dataset(
        where["task"], where["seed"], where["size"], json.dumps(where["config"], sort_keys=True)
    )
    entry = dataset[extra_info["index"]]
    score = float(dataset.score_answer(answer=extract_answer(solution_str), entry=entry))
    return {"score": score, "acc": score >= 1.0}
