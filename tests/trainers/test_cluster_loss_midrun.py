"""The embedded cluster lost during training (a real `hybridflow train`, its GCS and later its raylet
SIGKILLed by pid): the supervisor above the driver names each loss in one line, starts a new cluster and
driver that resume from the last checkpoint, and the run ends with exit 0 and one history in
metrics.jsonl; no process of the lost drivers survives. One run covers both kinds (docs/operations.md)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.trainers.lifecycle_helpers import (
    alive,
    cmdline,
    descendants,
    grpo_config,
    metric_rows,
    start_train,
    wait_for,
)

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)


def _kill_after_row(proc, run: Path, step: int, kind: str) -> tuple[int, set[int]]:
    """SIGKILL the run's `kind` process (gcs_server / raylet) once metrics row `step` is written (its
    checkpoint is committed right after it); -> its pid and the processes below `hybridflow train` then."""
    wait_for(lambda: any(r["step"] == step for r in metric_rows(run)), proc, poll=0.01)
    tree = descendants(proc.pid)
    (victim,) = [p for p in tree if cmdline(p).split(" ")[0].endswith(kind)]
    os.kill(victim, signal.SIGKILL)
    return victim, tree


def test_gcs_then_raylet_lost_mid_run_each_restart_the_cluster_and_resume(tiny_model_dir, tmp_path):
    run, log = tmp_path / "run", tmp_path / "run.log"
    config = grpo_config(
        tmp_path,
        tiny_model_dir,
        trainer="experiment_name: run, total_steps: 5, save_every: 1, loggers: [jsonl]",
    )
    # each step at least 8 x 0.15 s (its 8 samples' rewards): the 4 steps left after the GCS's loss take
    # longer than the supervisor's 2 s wait for an outcome on any machine (calls to running workers do not
    # need the GCS: a driver that finished its run within that wait would rightly end done, not restart)
    (tmp_path / "reward.py").write_text(
        "import time\n\n"
        "def overlap(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    time.sleep(0.15)\n"
        "    return sum(c in ground_truth for c in solution_str) / 4.0\n"
    )
    proc = start_train(config, log=log)
    # the GCS first, then the raylet
    gcs, first = _kill_after_row(proc, run, 1, "gcs_server")
    wait_for(lambda: "resumed from step" in log.read_text(), proc, poll=0.05)
    raylet, second = _kill_after_row(proc, run, 3, "raylet")
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]

    text = log.read_text()
    lines = [
        x.removeprefix("hybridflow train: ") for x in text.splitlines() if x.startswith("hybridflow train:")
    ]
    restarts = [x for x in lines if x.startswith("restart ")]
    assert len(restarts) == 2, lines
    # ("lost its raylet (pid N)", or, where Ray ended the driver before the loss was seen, every
    # process of the cluster gone by then and "(Ray ended the driver, exit 1)")
    pattern = r"restart {n}/3: the embedded Ray cluster lost its .*{what}.* during training; a new cluster resumes from the newest checkpoint"  # fmt: skip
    assert re.fullmatch(pattern.format(n=1, what=rf"gcs_server \(pid {gcs}\)"), restarts[0]), restarts
    assert re.fullmatch(pattern.format(n=2, what=rf"raylet \(pid {raylet}\)"), restarts[1]), restarts
    # each new driver resumed from the newest checkpoint before its loss (row k is written just before step_k's commit)
    resumed = re.findall(r"resumed from step (\d+) \(restart \d/3: .*/run/checkpoints/step_(\d+)\)", text)
    assert len(resumed) == 2 and all(a == b for a, b in resumed), resumed
    assert int(resumed[0][0]) >= 1 and int(resumed[1][0]) >= 3, resumed
    print("\n".join(lines))
    assert (
        lines[-2].startswith("done, 5 steps;") and lines[-1].startswith("report ") and "Traceback" not in text
    )
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(6))  # one history: the rows after a checkpoint redone once
    assert rows[-1]["trainer/restarts"] == 2
    deadline = time.monotonic() + 10
    while alive(first | second) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(first | second) == []
