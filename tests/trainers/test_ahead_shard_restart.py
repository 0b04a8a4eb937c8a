"""A tensor-parallel rollout pool (tg = 2, each rank holding only its generation shard: rollout/pool_tp.py)
after a dead worker: `hybridflow train` restarts from the last checkpoint, the new rollout ranks load
their shards from model.path again and are synced their slices (workers/shard_sync.py), and the run's
numbers equal the uninterrupted run's. Real processes, Ray, gloo, the tiny Llama."""

from __future__ import annotations

import re

from hybridflow.config import load_config
from hybridflow.trainers import build_trainer
from tests.trainers.lifecycle_helpers import (
    comparable,
    grpo_config,
    kill_a_worker_after,
    metric_rows,
    start_train,
)
from tests.trainers.test_ahead_plans import _ahead_plan_file, _shard_bytes


def test_a_restarted_shard_pool_repeats_the_uninterrupted_run(ray_cluster, tiny_model_dir, tmp_path, capsys):
    plan = _ahead_plan_file(tiny_model_dir, tmp_path, capsys)  # rollout pool: 2 devices, tg = 2
    config = grpo_config(
        tmp_path, tiny_model_dir, resources=f"n_gpus_per_node: 3, placement: '{plan}'",
        trainer="experiment_name: run, total_steps: 4, save_every: 2, rollout_ahead: 1, "
        "val_before_train: false, loggers: [jsonl]",
    )  # fmt: skip
    run = tmp_path / "run"
    proc = start_train(config, log=tmp_path / "first.log")
    kill_a_worker_after(run, 2, proc, pick=max)  # during step 3
    assert proc.wait(timeout=600) == 0
    log = (tmp_path / "first.log").read_text()
    assert re.search(r"restart 1/\d+ at step", log) and "restart 2/" not in log, log[-2000:]
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["trainer/restarts"] == 1
    # every sync after the restart too sends each rollout rank its shard only
    assert {r["sync/bytes"] for r in rows if "sync/bytes" in r} == {_shard_bytes(tiny_model_dir, 2)}

    cfg = load_config(config, ["trainer.experiment_name=whole"])
    with build_trainer(cfg) as trainer:
        whole = trainer.fit()
    assert [comparable(r) for r in rows] == [comparable(r) for r in whole]
