"""CPU threads per rank follow the placement (controller/process.py cpu_threads): a rank takes its
node's cores // the ranks of every pool that can compute at the same time on that node. Colocated
roles share one process (they take turns), so a one-pool run keeps the whole machine; split pools and
the rollout pool of trainer.rollout_ahead=1 split it, so overlapped phases do not oversubscribe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.controller import ResourcePool, share_cpus
from hybridflow.controller.process import cpu_threads

ROOT = Path(__file__).resolve().parents[2]


def _pool(nodes: list[str]) -> ResourcePool:
    pool = ResourcePool.__new__(ResourcePool)  # the rank -> node map only, no reservation
    pool.node_of_rank = nodes
    pool.cpu_ranks_per_node = {n: nodes.count(n) for n in nodes}
    return pool


def test_share_cpus_counts_every_pool_on_the_node(monkeypatch):
    actor, critic, rollout = _pool(["a", "a", "b"]), _pool(["a"]), _pool(["b", "b"])
    assert [actor.cpu_ranks(r) for r in range(3)] == [2, 2, 1]  # alone: its own ranks per node
    share_cpus([actor, critic, rollout])
    assert [actor.cpu_ranks(r) for r in range(3)] == [3, 3, 3]
    assert critic.cpu_ranks(0) == 3 and rollout.cpu_ranks(1) == 3
    monkeypatch.delenv("HYBRIDFLOW_CPU_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [cpu_threads(n, use_gpu=False) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("HYBRIDFLOW_CPU_THREADS", "5")
    assert cpu_threads(3, use_gpu=False) == 5  # the override wins


def test_worker_threads_colocate_vs_split_vs_rollout_pool():
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: every placement gives one thread per rank")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    env.pop("HYBRIDFLOW_CPU_THREADS", None)  # the session pins it; the rule is what a user gets
    env.pop("OMP_WAIT_POLICY", None)  # `make test` exports it; the default is what a user gets
    env.pop("GOMP_SPINCOUNT", None)
    for key in ("MALLOC_CONF", "LD_PRELOAD", "RAY_LD_PRELOAD_ON_WORKERS"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.trainers.threads_check"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    assert r["colocate_1"] == {"actor_rollout": [cores]}  # one pool: the whole machine, as before
    half = cores // 2  # two pools of one device each run at once: half the cores each
    assert r["split_2"] == {"actor_rollout": [half], "critic": [half]}
    assert r["rollout_ahead_2"] == {"actor_rollout": [half], "rollout": [half]}
    # Every worker process started with a short OpenMP spin and no wait policy
    # (resource_pool.embedded_worker_env), the driver's environment left as it was; a driver's own
    # OMP_WAIT_POLICY reaches the workers instead, with no spin count above it.
    assert r["driver_wait_policy"] is None
    for name in ("colocate_1", "split_2", "rollout_ahead_2"):
        assert {k: set(v) for k, v in r[name + "_spin_count"].items()} == dict.fromkeys(r[name], {"3000"})
        assert {k: set(v) for k, v in r[name + "_wait_policy"].items()} == dict.fromkeys(r[name], {None})
    assert r["user_wait_policy"] == {"actor_rollout": ["passive"]}
    assert r["user_spin_count"] == {"actor_rollout": [None]}
    # workers that compute on CPU keep freed memory for their next tensors (Ray's jemalloc, preloaded by
    # resource_pool.embedded_worker_env): a 256 MB tensor allocated again faults no page of its own in (the
    # worker's other threads fault a few: up to 18 seen with the other pytest worker busy); with glibc it faults
    # every page of it in again, >= 128 even with 2 MB pages
    for name in ("colocate_1", "split_2", "rollout_ahead_2"):
        refaults = r[name + "_refaults"]
        assert all(n <= 40 for faults in refaults.values() for n in faults), refaults
    assert all(n >= 128 for n in r["gpu_run_refaults"]["actor_rollout"]), r["gpu_run_refaults"]
