"""Failures reach the driver named by group, rank and method; a dead process is reported, not a hang."""

from __future__ import annotations

import contextlib
import time

import pytest

from hybridflow.controller import ResourcePool, WorkerDiedError, WorkerError, WorkerGroup
from tests.controller.workers import DataWorker, FailingInit

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)


def test_worker_exception_names_group_rank_method_and_traceback(groups2):
    g = groups2["dp"]
    with pytest.raises(WorkerError) as info:
        g.fail_on(1)
    err = info.value
    assert (err.group, err.rank, err.method) == ("dp", 1, "fail_on")
    assert "boom on rank 1" in str(err) and 'workers.py", line' in err.remote_traceback
    assert "in fail_on" in err.remote_traceback
    assert "rank 1" in str(err) and "'fail_on'" in str(err)
    assert [i["rank"] for i in g.info()] == [0, 1]  # the group is still usable


def test_failure_while_peers_wait_in_a_collective_and_worker_death(groups2):
    # A second, separate group on the same pool: its own processes and process group.
    g = WorkerGroup(DataWorker, groups2["dp"].pool, group_name="doomed")
    try:
        assert set(g.pids).isdisjoint(groups2["dp"].pids)
        t0 = time.perf_counter()
        with pytest.raises(WorkerError) as info:
            g.fail_in_collective(1)  # rank 0 is now stuck in all_reduce: report rank 1 anyway
        assert info.value.rank == 1 and info.value.method == "fail_in_collective"
        assert time.perf_counter() - t0 < 30
        with pytest.raises(WorkerDiedError) as died:
            g.die(1)
        assert (died.value.group, died.value.rank, died.value.method) == ("doomed", 1, "die")
        assert "died" in str(died.value)
    finally:
        g.shutdown()


def test_constructor_failure_is_reported_with_rank_and_class(ray_cluster):
    with ResourcePool(1, name="bad") as pool:
        with pytest.raises(WorkerError) as info:
            WorkerGroup(FailingInit, pool)
        assert info.value.rank == 0 and info.value.method == "FailingInit.__init__"
        assert "cannot build on rank 0" in str(info.value)


def test_pool_larger_than_cluster_says_what_was_asked_and_what_exists(ray_cluster):
    have = int(ray_cluster.cluster_resources()["CPU"])
    with pytest.raises(ValueError, match=rf"asks for 1000 CPU device.*has 0 GPU and {have} CPU in total"):
        ResourcePool(1000, name="huge")
    with pytest.raises(ValueError, match="asks for 1 GPU device"):
        ResourcePool(1, name="gpu", use_gpu=True)


def test_a_reservation_the_cluster_cannot_meet_now_fails_at_its_timeout(ray_cluster):
    """Every CPU free now held by one pool: the next pool's reservation fails after its timeout_s, in one
    line naming what is free, not in a wait that never ends."""
    with contextlib.ExitStack() as held:
        # Ray's view of what is free lags a pool released just before (another test's): hold what it shows
        # free until, once it has caught up with this test's own pools, nothing whole is left
        for k in range(10):
            free = int(ray_cluster.available_resources().get("CPU", 0))
            if free < 1:
                break
            held.enter_context(ResourcePool(free, name=f"all{k}"))
            time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(
            RuntimeError, match=r"could not reserve 1 x \{'CPU': 1.0\} within 2s; free now: CPU=0"
        ):
            ResourcePool(1, name="late", timeout_s=2)
        assert time.monotonic() - start < 30
