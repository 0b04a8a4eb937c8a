"""Rows the Python API is given (a `datasets.Dataset`, a list of dicts, a file) -> verl-format prompt rows.

A row names its prompt in one column (text or chat messages); the ground truth is the first of
`ground_truth`, `answer`, `solution` it has (or the column named); every column but the prompt is kept
in `extra_info`, from where a TRL-convention reward function receives it as a keyword argument
(rewards/conventions.py); a prompt of chat messages is kept there too (extra_info['prompt']), so that
such a function gets `prompts` and `completions` as message lists, as TRL gives them. Rows already in verl's layout (a `reward_model` or `extra_info` column) are
kept as they are. Values must survive JSON (numpy scalars and arrays become numbers and lists): the
rows are written to a file that the run reads like any other data file, and its config names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from hybridflow.errors import DatasetError

GROUND_TRUTH_COLUMNS = ("ground_truth", "answer", "solution")
CHAT_PROMPT = "prompt"  # extra_info's key for a chat prompt (rewards/conventions.py reads it by this name)
DEFAULT_SOURCE = "dataset"  # the data_source of rows without one: names their val/<source>/ metrics


def rows_of(source: Any, what: str) -> list[dict]:
    """The rows of a `datasets.Dataset` (anything with `to_list()`), a list of dicts or a Parquet /
    JSONL / JSON file; `what` names the argument in errors."""
    if isinstance(source, (str, os.PathLike)):
        from hybridflow.data.files import read_rows, where

        rows = []
        for i, row in read_rows(source):
            if isinstance(row, Exception):
                raise DatasetError(f"{what}: {where(source, i)}: {row}")
            rows.append(row)
        return rows
    if hasattr(source, "to_list"):  # datasets.Dataset (pandas: DataFrame.to_dict("records"))
        source = source.to_list()
    if not isinstance(source, Iterable) or isinstance(source, Mapping):
        raise DatasetError(
            f"{what}: expected a datasets.Dataset, a list of dicts or a file path, got {type(source).__name__}"
        )
    rows = list(source)
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
    if bad is not None:
        raise DatasetError(f"{what}: row {bad + 1} is a {type(rows[bad]).__name__}, not a mapping of columns")
    if not rows:
        raise DatasetError(f"{what}: no rows")
    return [dict(r) for r in rows]


def ground_truth_column(rows: list[dict], named: str | None) -> str | None:
    """The column holding the ground truth: `named` (which every row must have), else the first of
    GROUND_TRUTH_COLUMNS the first row has; None when there is none."""
    if named is not None:
        missing = next((i for i, r in enumerate(rows) if named not in r), None)
        if missing is not None:
            raise DatasetError(
                f"row {missing + 1} has no column {named!r} (ground_truth_column); it has {sorted(rows[missing])}"
            )
        return named
    return next((c for c in GROUND_TRUTH_COLUMNS if c in rows[0]), None)


def to_prompt_rows(
    rows: list[dict], prompt_column: str, truth_column: str | None, what: str, targets: tuple[str, ...] = ()
) -> list[dict]:
    """verl-format rows: prompt, data_source, reward_model.ground_truth, extra_info (every other column).
    targets: SFT's response / DPO's chosen and rejected columns, kept beside the prompt, where the pair
    datasets (data/pairs.py) read them, as they read a data file's rows."""
    out = []
    for i, row in enumerate(rows, start=1):
        if "reward_model" in row or "extra_info" in row:
            out.append(_json_safe({**row, "prompt": row.get(prompt_column)}, i, what))
            continue
        if prompt_column not in row:
            raise DatasetError(
                f"{what}: row {i} has no {prompt_column!r} column (prompt_column); it has {sorted(row)}"
            )
        columns = {k: v for k, v in row.items() if k != prompt_column and k not in targets}
        if isinstance(row[prompt_column], list):  # chat messages: a TRL reward gets them as `prompts`
            columns.setdefault(CHAT_PROMPT, row[prompt_column])
        converted = {
            "prompt": row[prompt_column],
            "data_source": row.get("data_source", DEFAULT_SOURCE),
            "reward_model": {"ground_truth": row.get(truth_column) if truth_column else None},
            "extra_info": columns,
            **{k: row[k] for k in targets if k in row},
        }
        out.append(_json_safe(converted, i, what))
    return out


def _json_safe(row: dict, i: int, what: str) -> dict:
    def plain(value):
        if hasattr(value, "tolist"):  # numpy arrays and scalars
            return value.tolist()
        raise TypeError(f"a {type(value).__name__} value")

    try:
        return json.loads(json.dumps(row, default=plain))
    except (TypeError, ValueError) as e:
        raise DatasetError(
            f"{what}: row {i}: {e} cannot be written to a data file (use text, numbers, lists, dicts)"
        ) from None
