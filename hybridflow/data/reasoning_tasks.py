"""`data.dataset=reasoning_gym:<task>`: prompts from reasoning-gym's procedural generators, offline.

reasoning-gym (the `reasoning-gym` extra) generates each problem of a task from `seed + index`, with a
verifier of its own (hybridflow/rewards/reasoning_tasks.py scores with it). Rows are in verl's format;
their `extra_info` names the generator (task, seed, size, config) and the index, which is all the scorer
needs to rebuild the problem: nothing but text travels with the batch. The training split is indices
0..size-1 of `data.seed`'s stream and the validation split the next `val_size` indices, so the two never
share a generated problem (a task with few distinct problems can still repeat one by content).

dataset_kwargs: size (training rows), val_size, system_prompt (true = reasoning-gym's default, which asks
for the answer in <answer> tags; false = none; or the text), and any keyword of the task's own config
(e.g. min_animals for leg_counting), checked by reasoning-gym.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata

from hybridflow.errors import DatasetError

PREFIX = "reasoning_gym:"
INSTALL = "pip install -c constraints.txt -e '.[reasoning-gym]'"


def _package():
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError:
        raise DatasetError(
            f"data.dataset: {PREFIX}<task> needs the reasoning-gym package, which is not installed; {INSTALL}"
        ) from None


def task_names() -> list[str]:
    """The task names this reasoning-gym release generates."""
    return sorted(_package().factory.DATASETS)


def check_task(task: str) -> None:
    names = task_names()
    if task not in names:
        near = difflib.get_close_matches(task, names, n=1)
        hint = f" (did you mean '{PREFIX}{near[0]}'?)" if near else ""
        raise DatasetError(
            f"data.dataset: reasoning-gym {importlib.metadata.version('reasoning-gym')} has no task {task!r}{hint}; its "
            f"{len(names)} tasks are the keys of reasoning_gym.factory.DATASETS"
        )


def _system_prompt(value) -> str:
    if value is True:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        return SYSTEM_PROMPTS["default"]
    if value is False or value is None:
        return ""
    if isinstance(value, str):
        return value
    raise ValueError(f"system_prompt must be true, false or text, got {value!r}")


def rows(
    task: str,
    split: str = "train",
    seed: int = 0,
    size: int = 1000,
    val_size: int = 100,
    system_prompt: bool | str = True,
    **config,
) -> list[dict]:
    """The split's rows of reasoning-gym task `task` (see the module docstring)."""
    check_task(task)
    val = split in ("val", "validation", "test")
    start, count = (size, val_size) if val else (0, size)
    try:
        dataset = _package().create_dataset(task, seed=seed + start, size=count, **config)
    except AssertionError as e:  # reasoning-gym's configs validate by assert
        raise ValueError(
            f"reasoning-gym rejected the config {config}: {e or 'a value out of range'}"
        ) from None
    system = _system_prompt(system_prompt)
    out = []
    for i in range(count):
        entry = dataset[i]
        prompt = [{"role": "system", "content": system}] if system else []
        out.append(
            {
                "data_source": PREFIX + task,
                "prompt": [*prompt, {"role": "user", "content": entry["question"]}],
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {
                    "split": split,
                    "index": i,
                    # how the scorer rebuilds this problem: create_dataset(task, seed, size, **config)[index]
                    "reasoning_gym": {"task": task, "seed": seed + start, "size": count, "config": config},
                },
            }
        )
    return out
