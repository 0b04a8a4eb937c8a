"""The PID namespace's init process (rewards/sandbox.py), forked by a reward worker before it imports the
user's module, keeps none of the worker's descriptors: the worker's pipe to the trainer closes when the
worker dies, whether or not the init had armed its parent-death signal by then. Before, a worker that
exited at import before its init ran that far (a race seen under load) left the pipe open in the init,
and the trainer waited out reward.startup_timeout_s to report a hang instead of the exit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hybridflow.rewards import RewardConfig, RewardExecutor


def _namespace_init(worker_pid: int) -> int:
    """The worker's child that is PID 1 of its namespace (the last NSpid field; others are samples)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            nspid = next(x for x in (proc / "status").read_text().splitlines() if x.startswith("NSpid:"))
        except (OSError, ValueError, StopIteration):
            continue
        if ppid == worker_pid and nspid.split()[-1] == "1":
            found.append(int(proc.name))
    (init,) = found
    return init


def test_the_namespace_init_holds_only_stdio(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with RewardExecutor(RewardConfig(fn=f"{path}:score", num_workers=1)) as ex:
        assert ex.score("src", ["a"], ["a"]).scores.tolist() == [1.0]
        (worker,) = ex._pool.workers
        if worker.containment != "pid_namespace":
            pytest.skip("no PID namespace here (needs root or CAP_SYS_ADMIN): the worker is a subreaper")
        init = _namespace_init(worker.proc.pid)
        assert sorted(int(fd) for fd in os.listdir(f"/proc/{init}/fd")) == [0, 1, 2]
