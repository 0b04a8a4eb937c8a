"""The training driver SIGKILLed at a checkpoint's commit instant (a real `hybridflow train`: the moment
`latest` names the new step): the supervisor's line names the driver, not the GCS and raylet that went with
it, a new driver resumes from that checkpoint, and metrics.jsonl holds exactly one row per step."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.trainers.lifecycle_helpers import (
    cmdline,
    descendants,
    grpo_config,
    metric_rows,
    start_train,
    wait_for,
)

pytestmark = pytest.mark.timing  # kills a process at an instant: run alone (Makefile)


def driver_pid(proc) -> int:
    """The training driver: the supervisor's child running hybridflow.trainers.cli."""
    return next(p for p in descendants(proc.pid) if "-m hybridflow.trainers.cli " in cmdline(p))


def kill_driver_at_commit(run: Path, step: int, proc) -> int:
    """SIGKILL the driver as soon as checkpoint `step` is committed (`latest` names it); -> its pid."""
    latest = run / "checkpoints" / "latest"
    wait_for(lambda: latest.exists() and latest.read_text().strip() == f"step_{step}", proc, poll=0.002)
    pid = driver_pid(proc)
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_driver_killed_at_the_commit_instant_is_named_and_resumed_with_one_row_per_step(
    tiny_model_dir, tmp_path
):
    run, log = tmp_path / "run", tmp_path / "run.log"
    config = grpo_config(
        tmp_path,
        tiny_model_dir,
        trainer="experiment_name: run, total_steps: 3, save_every: 1, loggers: [jsonl]",
    )
    proc = start_train(config, log=log)
    pid = kill_driver_at_commit(run, 2, proc)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    restarts = [x for x in text.splitlines() if x.startswith("hybridflow train: restart ")]
    # was: "the embedded Ray cluster lost its gcs_server (pid N), raylet (pid M)", after the driver's death
    assert restarts == [
        f"hybridflow train: restart 1/3: the driver (pid {pid}) was killed by SIGKILL during training; "
        "a new cluster resumes from the newest checkpoint"
    ], restarts
    assert re.search(r"resumed from step 2 \(restart 1/3: .*/run/checkpoints/step_2\)", text), text[-3000:]
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # was [0, 1, 3]: step 2's row came after its commit
