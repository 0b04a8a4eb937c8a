"""The embedded cluster's GCS lost after a run's last checkpoint (a real `hybridflow train`, its gcs_server
found below it by pid): the run still ends with exit 0 and its `done` line, one line names the loss, and
none of the run's processes survives."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.trainers.lifecycle_helpers import (
    alive,
    cmdline,
    descendants,
    grpo_config,
    start_train,
    wait_for,
)

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)


def _latest(run: Path) -> str:
    try:
        return (run / "checkpoints" / "latest").read_text().strip()
    except OSError:
        return ""


def test_gcs_lost_after_the_last_checkpoint_still_ends_done_with_exit_0(tiny_model_dir, tmp_path):
    config = grpo_config(
        tmp_path, tiny_model_dir, trainer="experiment_name: run, total_steps: 2, save_every: 2"
    )
    proc = start_train(config, log=tmp_path / "run.log")
    wait_for(lambda: _latest(tmp_path / "run") == "step_2", proc, poll=0.005)
    tree = descendants(proc.pid)
    gcs = [p for p in tree if cmdline(p).split(" ")[0].endswith("gcs_server")]
    assert len(gcs) == 1 and proc.poll() is None  # the run is still shutting down when its GCS goes
    os.kill(gcs[0], signal.SIGKILL)
    start = time.monotonic()
    rc = proc.wait(timeout=120)
    took = time.monotonic() - start
    lines = [x for x in (tmp_path / "run.log").read_text().splitlines() if x.startswith("hybridflow train:")]
    assert rc == 0, lines
    # the outcome is printed before the shutdown, the loss during it
    assert lines[-2].startswith("hybridflow train: done, 2 steps;"), lines
    assert lines[-1] == (
        f"hybridflow train: the embedded Ray cluster lost its gcs_server (pid {gcs[0]}); its processes were "
        "killed without a Ray shutdown"
    )
    assert took < 30  # not Ray's 60 s reconnect timeout
    deadline = time.monotonic() + 10
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(tree) == []
