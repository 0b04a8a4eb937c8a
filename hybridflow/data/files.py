"""Read and write dataset rows (Parquet or JSONL), keeping each row's file and row number for errors.

Row numbers are 1-based everywhere: for JSONL the line number, for Parquet the record's position.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SUFFIXES = (".parquet", ".jsonl", ".json")


class DatasetError(ValueError):
    """A dataset problem, naming the file and row."""


def where(path: str | os.PathLike, row: int) -> str:
    return f"{path}, row {row}"


def read_rows(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield (row number, record) from a .parquet, .jsonl or .json (a list of records) file.

    A JSONL line that is not valid JSON yields a ValueError instance as its record, so the caller
    decides whether it fails the load or is skipped and reported (data.on_malformed).
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, record in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, record
    elif path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, ValueError(f"not valid JSON ({e.msg} at column {e.colno})")
    elif path.suffix == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for i, record in enumerate(data if isinstance(data, list) else [data], start=1):
            yield i, record
    else:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use one of {SUFFIXES}")


def write_parquet(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write records to Parquet (nested dicts/lists become struct/list columns, as in verl's files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
