"""Prompt datasets: verl-format rows -> chat-templated, tokenised, length-checked prompts.

Columns (verl's): `prompt` (chat messages [{role, content}] or plain text; the name is
data.prompt_key), `data_source` (routes the rule reward), `reward_model.ground_truth` (a top-level
`ground_truth` is accepted too, and in TRL-style rows without `reward_model` an `answer` or `solution`),
`extra_info` (free dict). Any other column (not verl's `ability`) joins `extra_info`, from where a
TRL-convention reward function receives it as a keyword argument (rewards/conventions.py).

Every row is checked when the dataset is built, so a malformed row (file + row number) fails the
run before any worker starts, or -- with data.on_malformed=skip -- is skipped and reported.
Prompts over data.max_prompt_length follow data.truncation, and the counts are logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.batch import Batch
from hybridflow.data.collate import left_pad, position_ids_from_mask
from hybridflow.data.columns import GROUND_TRUTH_COLUMNS
from hybridflow.data.files import read_rows, where
from hybridflow.errors import DatasetError

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import DataConfig

logger = logging.getLogger("hybridflow.data")

VERL_COLUMNS = frozenset({"data_source", "reward_model", "ground_truth", "extra_info", "ability"})
Record = tuple[str, int, Any]  # (source file or dataset name, 1-based row number, row)


@dataclass
class PromptSample:
    index: int  # position in the dataset (stable across epochs; part of the uid)
    input_ids: list[int]
    prompt_text: str  # the rendered prompt (after the chat template and any truncation)
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)


# ---- row parsing -------------------------------------------------------------------------------
def parse_prompt(value: Any, key: str) -> str | list[dict]:
    """Check a prompt cell: non-empty text, or a list of {role, content} messages."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"'{key}' is empty")
        return value
    if isinstance(value, list) and value:
        for j, m in enumerate(value):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise ValueError(f"'{key}'[{j}] is not a {{'role': str, 'content': str}} message: {m!r}")
        return [{"role": m["role"], "content": m["content"]} for m in value]
    if value is None:
        raise ValueError(f"missing '{key}' column")
    raise ValueError(f"'{key}' must be text or a non-empty list of chat messages, got {type(value).__name__}")


def parse_row(row: Any, prompt_key: str, missing_ground_truth: str = "ignore") -> dict:
    """-> {prompt, data_source, ground_truth, extra_info}; raises ValueError saying what is wrong
    (with missing_ground_truth="error", also for a row without a ground truth)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a mapping of columns, got {type(row).__name__}")
    prompt = parse_prompt(row.get(prompt_key), prompt_key)
    rm = row.get("reward_model")
    if rm is not None and not isinstance(rm, dict):
        raise ValueError(
            f"'reward_model' must be a mapping like {{'ground_truth': ...}}, got {type(rm).__name__}"
        )
    gt = (rm or {}).get("ground_truth", row.get("ground_truth"))
    if gt is None and rm is None:  # TRL-style {prompt, answer} rows
        gt = next((row[c] for c in GROUND_TRUTH_COLUMNS if row.get(c) is not None), None)
    if isinstance(gt, (int, float)) and not isinstance(gt, bool):
        gt = str(gt)
    if gt is None and missing_ground_truth == "error":
        raise ValueError(
            "no ground truth (reward_model.ground_truth) for the rule reward; set "
            "data.missing_ground_truth=warn to score such rows anyway, or ignore for rewards that need none"
        )
    source = row.get("data_source", "unknown")
    if not isinstance(source, str):
        raise ValueError(f"'data_source' must be text, got {source!r}")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"'extra_info' must be a mapping, got {type(extra).__name__}")
    columns = {k: v for k, v in row.items() if k not in VERL_COLUMNS and k != prompt_key and k not in extra}
    extra = {**extra, **columns} if columns else extra
    return {"prompt": prompt, "data_source": source, "ground_truth": gt, "extra_info": extra}


def render_prompt(
    prompt: str | list[dict], tokenizer, apply_chat_template: bool, tools: list | None = None
) -> str:
    """Text the model sees: the tokenizer's chat template (with the generation prompt; `tools`: the JSON
    schemas of the tools the rollout may call, rollout.multi_turn), or raw text."""
    if not apply_chat_template:
        return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
            "set data.apply_chat_template=false to use prompts as plain text"
        )
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def iter_records(files: Sequence[str | os.PathLike]) -> Iterable[Record]:
    for path in files:
        for i, row in read_rows(path):
            yield str(path), i, row


def check_records(
    records: Iterable[Record], parse, on_malformed: str, stats: dict
) -> list[tuple[str, int, Any]]:
    """Parse every record; collect the malformed ones (file + row) and fail or skip per on_malformed."""
    good, bad = [], []
    for source, i, row in records:
        try:
            if isinstance(row, ValueError):
                raise row
            good.append((source, i, parse(row)))
        except ValueError as e:
            bad.append(f"{where(source, i)}: {e}")
    stats["malformed"] = len(bad)
    if bad and on_malformed == "error":
        shown = "\n  ".join(bad[:10]) + (f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise DatasetError(
            f"{len(bad)} malformed row(s):\n  {shown}\n(fix the data, or set data.on_malformed=skip to skip them)"
        )
    for msg in bad:
        logger.warning("skipping malformed row: %s", msg)
    return good


def fit_length(ids: list[int], limit: int, truncation: str, what: str) -> list[int] | None:
    """Apply the truncation policy: the ids, cut ids, None (filtered), or a DatasetError."""
    if len(ids) <= limit:
        return ids
    if truncation == "left":
        return ids[-limit:]
    if truncation == "right":
        return ids[:limit]
    if truncation == "filter":
        return None
    raise DatasetError(
        f"{what}: {len(ids)} tokens exceed the limit of {limit}; raise the limit or set "
        "data.truncation to left|right|filter"
    )


# ---- the dataset -------------------------------------------------------------------------------
class PromptDataset:
    """Tokenised prompts; `collate` turns a list of samples into a left-padded `Batch`."""

    def __init__(self, samples: list[PromptSample], pad_token_id: int, stats: dict, name: str = ""):
        self.samples, self.pad_token_id, self.stats, self.name = samples, pad_token_id, stats, name

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> PromptSample:
        return self.samples[i]

    def mean_length(self) -> float:
        """Mean tokens of a prompt (0 for none): what packed passes compute of one (the planner's time)."""
        return sum(len(s.input_ids) for s in self.samples) / len(self.samples) if self.samples else 0.0

    def longest_length(self) -> int:
        """Tokens of the longest prompt (0 for none): the width a batch holding it is padded to."""
        return max((len(s.input_ids) for s in self.samples), default=0)

    @classmethod
    def from_records(
        cls,
        records: Iterable[Record],
        tokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        truncation: str = "error",
        on_malformed: str = "error",
        apply_chat_template: bool = True,
        missing_ground_truth: str = "ignore",
        name: str = "",
        tools: list | None = None,
    ) -> PromptDataset:
        """missing_ground_truth: a row without one is malformed (error), counted and warned (warn), or
        accepted (ignore); the trainer passes data.missing_ground_truth under a rule reward."""
        stats = {"rows": 0, "malformed": 0, "truncated": 0, "filtered": 0}
        records = list(records)
        stats["rows"] = len(records)
        parse = lambda r: parse_row(r, prompt_key, missing_ground_truth)  # noqa: E731
        parsed = check_records(records, parse, on_malformed, stats)
        stats["no_ground_truth"] = sum(p["ground_truth"] is None for _, _, p in parsed)
        if stats["no_ground_truth"] and missing_ground_truth == "warn":
            first = next(where(src, i) for src, i, p in parsed if p["ground_truth"] is None)
            logger.warning(
                "dataset %s: %d of %d rows have no ground truth (first: %s); the reward sees None for them",
                name, stats["no_ground_truth"], len(parsed), first,
            )  # fmt: skip
        texts = [render_prompt(p["prompt"], tokenizer, apply_chat_template, tools) for _, _, p in parsed]
        # a raw-text prompt gets the tokenizer's special tokens (e.g. BOS); a templated one has them
        encoded = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"] if texts else []
        samples = []
        for (source, i, p), text, ids in zip(parsed, texts, encoded):
            kept = fit_length(ids, max_prompt_length, truncation, f"{where(source, i)}: prompt")
            if kept is None:
                stats["filtered"] += 1
                continue
            if len(kept) < len(ids):
                stats["truncated"] += 1
                text = tokenizer.decode(kept)
            samples.append(
                PromptSample(len(samples), kept, text, p["data_source"], p["ground_truth"], p["extra_info"])
            )
        stats["kept"] = len(samples)
        log = logger.warning if stats["filtered"] or stats["truncated"] or stats["malformed"] else logger.info
        log(
            "dataset %s: %d rows, %d kept, %d truncated, %d filtered (over %d tokens), %d malformed",
            name, stats["rows"], stats["kept"], stats["truncated"], stats["filtered"], max_prompt_length,
            stats["malformed"],
        )  # fmt: skip
        if not samples:
            raise DatasetError(f"dataset {name}: no prompts left ({stats})")
        return cls(samples, _pad_id(tokenizer), stats, name)

    def reward_columns(self) -> set[str]:
        """What a TRL-convention reward function may ask for by name (rewards/conventions.py): the rows'
        extra_info keys, ground_truth and data_source."""
        return {"ground_truth", "data_source"} | {k for s in self.samples for k in s.extra_info}

    def collate(self, samples: list[PromptSample], epoch: int = 0) -> Batch:
        """-> Batch: input_ids, attention_mask, position_ids (B, L) left-padded; non-tensors uid
        ('{epoch}-{index}', the GRPO group id), data_source, ground_truth, prompt_text, extra_info, index."""
        ids, mask = left_pad([s.input_ids for s in samples], self.pad_token_id)
        return Batch(
            {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)},
            {
                "uid": [f"{epoch}-{s.index}" for s in samples],
                "data_source": [s.data_source for s in samples],
                "ground_truth": [s.ground_truth for s in samples],
                "prompt_text": [s.prompt_text for s in samples],
                "extra_info": [s.extra_info for s in samples],
                "index": [s.index for s in samples],
            },
        )


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


def dataset_records(cfg: DataConfig, split: str) -> tuple[list[Record], str] | None:
    """Records for a split from data.train_files/val_files, else from the registered data.dataset."""
    files = cfg.train_files if split == "train" else cfg.val_files
    if files:
        return list(iter_records(files)), ",".join(map(str, files))
    if cfg.dataset:
        from hybridflow.data.registry import build_rows

        rows = build_rows(cfg.dataset, split, cfg.seed, cfg.dataset_kwargs)
        source = f"{cfg.dataset}[{split}]"
        return [(source, i, row) for i, row in enumerate(rows, start=1)], source
    return None


def build_prompt_dataset(
    cfg: DataConfig,
    tokenizer,
    split: str = "train",
    need_ground_truth: bool = True,
    tools: list | None = None,
) -> PromptDataset | None:
    """The prompt dataset of `split` ('train' or 'val') per a DataConfig; None if it has no data.
    need_ground_truth: the reward reads one (a rule reward), so data.missing_ground_truth applies;
    tools: JSON schemas given to the chat template (agent.tool_schemas)."""
    found = dataset_records(cfg, split)
    if found is None:
        return None
    records, name = found
    return PromptDataset.from_records(
        records,
        tokenizer,
        prompt_key=cfg.prompt_key,
        max_prompt_length=cfg.max_prompt_length,
        truncation=cfg.truncation,
        on_malformed=cfg.on_malformed,
        apply_chat_template=cfg.apply_chat_template,
        missing_ground_truth=cfg.missing_ground_truth if need_ground_truth else "ignore",
        name=name,
        tools=tools,
    )
