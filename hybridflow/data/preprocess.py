"""GSM8K and MATH -> verl-style Parquet, from local copies of their standard files.

GSM8K: JSONL rows {question, answer}, the answer ending in '#### <number>'.
MATH (Hendrycks): one JSON object per problem file (train/<subject>/<n>.json) or JSONL rows, with
{problem, solution, level, type}; the answer is the last \\boxed{...} in the solution.
Output rows carry data_source, prompt (one user message with verl's instruction), ability,
reward_model {style: rule, ground_truth}, extra_info {split, index, ...} -- the columns the prompt
dataset reads and the rule rewards route on (data_source 'openai/gsm8k' and
'DigitalLearningGmbH/MATH-lighteval', as in verl).
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from hybridflow.data.files import SUFFIXES, read_rows, where, write_parquet
from hybridflow.errors import DatasetError

GSM8K_SOURCE = "openai/gsm8k"
MATH_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_gsm8k_answer(answer: str) -> str:
    """'... #### 1,234' -> '1234' (commas dropped, as verl does)."""
    match = _GSM8K_ANSWER.search(answer)
    if match is None:
        raise ValueError("answer has no '#### <number>' line")
    return match.group(1).replace(",", "").rstrip(".")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}, or '\\boxed 5'), with nested braces."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    if rest.startswith("\\boxed "):  # '\boxed 5' form: up to the next '$' or whitespace
        return rest[len("\\boxed ") :].split("$")[0].split()[0]
    start = rest.find("{")
    if start < 0:
        return None
    depth = 0
    for j, ch in enumerate(rest[start:], start=start):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[start + 1 : j]
    return None  # unbalanced braces


def input_files(path: str | os.PathLike, split: str = "train") -> list[Path]:
    """The data files `--input` names: a file; a glob (`data/train-*.parquet`); or a directory, such as
    an HF dataset snapshot, whose files for `split` are used (a file named `split-...`/`split.*` or
    under a `split/` folder; all files when none is), preferring a `main/` config folder (GSM8K's)."""
    text = str(path)
    if any(c in text for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).suffix in SUFFIXES)
        if not files:
            raise DatasetError(f"--input {text!r}: no {'/'.join(SUFFIXES)} files match")
        return files
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = sorted(
        p for p in path.rglob("*")
        if p.suffix in SUFFIXES and p.is_file() and not any(s.startswith(".") for s in p.relative_to(path).parts)
    )  # fmt: skip
    if not files:
        raise DatasetError(f"--input {text!r}: no {'/'.join(SUFFIXES)} files in this directory")
    main = [p for p in files if "main" in p.relative_to(path).parts[:-1]]
    files = main or files
    named = re.compile(rf"^{re.escape(split)}([-_.]|$)")
    for_split = [p for p in files if named.match(p.name) or split in p.relative_to(path).parts[:-1]]
    return for_split or files


def _rows(path, split: str, limit: int, convert) -> list[dict]:
    """The rows `convert(record, split, index)` makes of every record under `path`; every malformed
    record (convert raises ValueError) is collected and reported at once, by file and row."""
    rows, bad = [], []
    for file in input_files(path, split):
        for i, rec in read_rows(file):
            try:
                if isinstance(rec, ValueError):
                    raise rec
                rows.append(convert(rec, split, len(rows)))
            except ValueError as e:
                bad.append(f"{where(file, i)}: {e}")
                continue
            if limit and len(rows) >= limit:
                break
        if limit and len(rows) >= limit:
            break
    _fail_on(bad)
    return rows


def _rule_row(source: str, question: str, instruction: str, truth: str, extra: dict) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


def _gsm8k_row(rec, split: str, index: int) -> dict:
    if not isinstance(rec, dict) or not isinstance(rec.get("question"), str):
        raise ValueError("expected {'question': str, 'answer': str}")
    answer = rec.get("answer")
    if not isinstance(answer, str):
        raise ValueError("missing 'answer' text")
    extra = {"split": split, "index": index, "question": rec["question"], "answer": answer}
    return _rule_row(GSM8K_SOURCE, rec["question"], GSM8K_INSTRUCTION, extract_gsm8k_answer(answer), extra)


def _math_row(rec, split: str, index: int) -> dict:
    if not isinstance(rec, dict) or not isinstance(rec.get("problem"), str):
        raise ValueError("expected {'problem': str, 'solution': str}")
    solution = rec.get("solution")
    truth = last_boxed(solution) if isinstance(solution, str) else None
    if truth is None:
        raise ValueError("solution has no \\boxed{...} answer")
    extra = {
        "split": split,
        "index": index,
        "level": str(rec.get("level", "")),
        "type": str(rec.get("type", "")),
    }
    return _rule_row(MATH_SOURCE, rec["problem"], MATH_INSTRUCTION, truth, extra)


def gsm8k_rows(path: str | os.PathLike, split: str = "train", limit: int = 0) -> list[dict]:
    """Rows from a GSM8K file, a directory (an HF snapshot: main/ preferred) or a glob."""
    return _rows(path, split, limit, _gsm8k_row)


def math_rows(path: str | os.PathLike, split: str = "train", limit: int = 0) -> list[dict]:
    """Rows from a MATH file or a directory tree of per-problem .json files (sorted, so stable)."""
    return _rows(path, split, limit, _math_row)


def _fail_on(bad: list[str]) -> None:
    if bad:
        shown = "\n  ".join(bad[:10]) + (f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise DatasetError(f"{len(bad)} malformed row(s):\n  {shown}")


def preprocess(kind: str, input_path, output_path, split: str = "train", limit: int = 0) -> tuple[Path, int]:
    """Write `kind` ('gsm8k' or 'math') rows from input_path to Parquet; -> (path, rows written)."""
    rows = {"gsm8k": gsm8k_rows, "math": math_rows}[kind](input_path, split, limit)
    if not rows:
        raise DatasetError(f"{input_path}: no rows")
    return write_parquet(rows, output_path), len(rows)
