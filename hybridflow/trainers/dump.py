"""Each step's generations as JSONL files (trainer.rollout_data_dir, trainer.validation_data_dir).

One file per step, `<dir>/<step>.jsonl`, one line per response, in verl's layout so its readers work
on ours: `input` (the rendered prompt), `output` (the response), `gts` (the ground truth, or null),
`score` (the sequence's reward score, before any KL penalty), `step`, plus the rule reward's extra
keys where they belong to these rows (validation; a training batch's scoring may have run a step
ahead, trainer.rollout_ahead, so its extras are not written). Validation writes its step's file
(step 0: before training).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridflow.checkpoint import atomic_write_text


def generation_rows(batch, scores, extras=()) -> list[dict]:
    """verl's dump rows of a finished batch (a Batch, or a trainer's Pending) and its scores (B,)."""
    local = getattr(batch, "local", batch)
    truths = local["ground_truth"] if "ground_truth" in local else [None] * len(local)
    values = [float(s) for s in scores]
    return [
        {
            "input": str(local["prompt_text"][i]),
            "output": str(local["response_text"][i]),
            "gts": None if truths[i] is None else str(truths[i]),
            "score": values[i],
            **(extras[i] if extras else {}),
        }
        for i in range(len(local))
    ]


def batch_scores(batch):
    """The sequence scores of a finished training batch: held by the driver for a rule reward,
    fetched from the step's experience for a reward model."""
    local = getattr(batch, "local", batch)
    return local["scores"] if "scores" in local else batch["scores"]


def write_generations(directory: str | os.PathLike, step: int, rows: list[dict]) -> Path:
    """`directory/<step>.jsonl` (written whole, atomically): the rows, each with its step."""
    path = Path(directory) / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    # verl's key order: input, output, gts, score, step, then the reward's extra keys
    lines = [json.dumps(_with_step(row, step), ensure_ascii=False) for row in rows]
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def _with_step(row: dict, step: int) -> dict:
    items = list(row.items())
    return dict([*items[:4], ("step", step), *items[4:]])
