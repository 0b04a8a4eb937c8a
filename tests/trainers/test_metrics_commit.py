"""A step's metrics row is written before the commit that makes the step resumable: a driver that dies
right after a checkpoint's commit (the rename and `latest` done, nothing after) leaves the step's row,
and the resumed run adds the later steps' rows, one row per step. A real trainer, killed in-process at
that instant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.checkpoint.manager import CheckpointManager
from hybridflow.trainers import build_trainer


class DriverDied(BaseException):
    """Not an Exception: nothing in the trainer handles it, as nothing runs after a SIGKILL."""


def test_a_driver_dying_at_the_commit_instant_loses_no_metrics_row(ray_cluster, make_config, monkeypatch):
    cfg = make_config("grpo", "trainer.total_steps=3", "trainer.save_every=2", "trainer.resume=auto",
                      "trainer.experiment_name=commit")  # fmt: skip
    prune = CheckpointManager.prune

    def die_once_committed(self):
        if self.latest_step() == 2:  # step_2 renamed into place and named by `latest`: resumable
            raise DriverDied
        return prune(self)

    monkeypatch.setattr(CheckpointManager, "prune", die_once_committed)
    with build_trainer(cfg) as trainer, pytest.raises(DriverDied):
        trainer.fit()
    monkeypatch.setattr(CheckpointManager, "prune", prune)
    metrics = Path(cfg.run_dir) / "metrics.jsonl"
    rows = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert rows == [0, 1, 2]  # was [0, 1]: the row came after the commit (0: validation before training)
    with build_trainer(cfg) as trainer:
        assert trainer.latest_checkpoint().name == "step_2"
        rest = trainer.fit()
    assert [h["step"] for h in rest] == [3]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["timing_s/save_checkpoint"] > 0  # the save's time is in the row written before its commit
