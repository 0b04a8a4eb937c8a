"""Read and write dataset rows (Parquet or JSONL), keeping each row's file and row number for errors.

Row numbers are 1-based everywhere: for JSONL the line number, for Parquet the record's position.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridflow.errors import DatasetError

SUFFIXES = (".parquet", ".jsonl", ".json")
# Python's JSON reader recurses once per level of nesting: past its recursion limit it raises RecursionError
_TOO_DEEP = (
    "nested deeper than a JSON reader can follow (lists or objects inside each other past Python's limit)"
)


def where(path: str | os.PathLike, row: int) -> str:
    return f"{path}, row {row}"


def read_rows(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """Yield (row number, record) from a .parquet, .jsonl or .json (a list of records) file.

    A JSONL line that is not valid JSON or not UTF-8 text yields a ValueError instance as its record, so
    the caller decides whether it fails the load or is skipped and reported (data.on_malformed). A file
    that cannot be read at all (missing, a directory or FIFO, no permission, not Parquet) is a DatasetError.
    """
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    if path.is_dir():
        raise DatasetError(f"dataset file {str(path)!r} is a directory; name the data files in it")
    if not path.is_file():  # a FIFO would block the read until a writer comes, a device never ends
        raise DatasetError(f"dataset file {str(path)!r} is not a regular file (a FIFO, device or socket)")
    if path.suffix not in SUFFIXES:
        raise DatasetError(f"{path}: unsupported file type {path.suffix!r}; use one of {SUFFIXES}")
    try:
        yield from _read(path)
    except OSError as e:  # permission denied, I/O error: says which file
        raise DatasetError(f"dataset file {str(path)!r} cannot be read: {e.strerror or e}") from None


def _read(path: Path) -> Iterator[tuple[int, Any]]:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except pa.ArrowException as e:
            raise DatasetError(f"{path}: not a readable Parquet file ({_first_line(e)})") from None
        yield from enumerate(table.to_pylist(), start=1)
    elif path.suffix == ".jsonl":
        with open(path, "rb") as f:  # bytes: one undecodable line is one malformed row, not a crash
            for i, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield i, ValueError(f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, ValueError(f"not valid JSON ({e.msg} at column {e.colno})")
                except RecursionError:
                    yield i, ValueError(_TOO_DEEP)
    else:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except UnicodeDecodeError as e:
            raise DatasetError(
                f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
            ) from None
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
            ) from None
        except RecursionError:
            raise DatasetError(f"{path}: {_TOO_DEEP}") from None
        yield from enumerate(data if isinstance(data, list) else [data], start=1)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


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
