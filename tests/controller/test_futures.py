"""Futures between groups of different dp size (never through the driver), and overlap of disjoint pools."""

from __future__ import annotations

import os
import time

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.controller import Future, get, shard_indices
from tests.controller.workers import publish_rows

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)


def _rows(n: int, n_shards: int, s: int) -> list[float]:
    rows, _ = shard_indices(n, n_shards, s)
    return torch.arange(n, dtype=torch.float32)[rows].tolist()


@pytest.mark.parametrize("producer,consumer", [(2, 4), (4, 2)])
def test_future_between_groups_of_different_dp_size_skips_the_driver(groups2, groups4, producer, consumer):
    src = (groups2 if producer == 2 else groups4)["dp"]
    dst = (groups2 if consumer == 2 else groups4)["dp"]
    n = 7
    # Each row carries a Tripwire that raises if unpickled in this (driver) process, and 128 KiB of
    # payload so the outputs live in the shared object store rather than inline in the driver.
    fut = src.produce(
        Batch({"x": torch.arange(n, dtype=torch.float32)}), driver_pid=os.getpid(), payload=32768
    )
    assert isinstance(fut, Future) and fut.sharded
    out = dst.consume(fut)  # would raise (in the driver) if the driver had deserialised `fut`
    assert out.keys() == ["x", "consumer_rank"]
    assert out["x"].tolist() == [float(i) for i in range(n)]
    # Each consumer rank received exactly its own shard (padded like a driver-side split would be).
    assert dst.last_x() == [_rows(n, consumer, s) for s in range(consumer)]
    with pytest.raises(Exception, match="driver deserialised"):
        fut.get()  # proves the tripwire is live: fetching in the driver does trip it


@pytest.mark.parametrize("producer,consumer", [(4, 2), (2, 4)])
def test_rows_of_a_future_reach_the_consumer_ranks_without_the_driver(groups2, groups4, producer, consumer):
    src = (groups2 if producer == 2 else groups4)["dp"]
    dst = (groups2 if consumer == 2 else groups4)["dp"]
    n, lo, hi = 11, 3, 9  # rows 3..8 span several producer shards
    fut = src.produce(
        Batch({"x": torch.arange(n, dtype=torch.float32)}), driver_pid=os.getpid(), payload=32768
    )
    part = fut.rows(lo, hi)
    out = dst.consume(part)  # would raise in the driver had it deserialised the producer's rows
    assert out["x"].tolist() == [float(i) for i in range(lo, hi)]
    # each consumer rank got its shard of the 6 rows, padded as a driver-side split of them would be
    assert dst.last_x() == [[lo + r for r in _rows(hi - lo, consumer, s)] for s in range(consumer)]
    assert dst.consume(part.rows(1, 3))["x"].tolist() == [4.0, 5.0]  # rows of rows
    with pytest.raises(TypeError, match="sharded"):
        groups2["dp"].info.future().rows(0, 1)


def test_future_into_3d_group_and_into_broadcast(groups2, groups4):
    n = 5
    fut = groups4["dp"].dp_async(Batch({"x": torch.arange(n, dtype=torch.float32)}))
    out = groups2["tp"].consume_3d(fut)  # tp=2, dp=1 on two ranks: both get the whole batch
    assert out["x"].tolist() == [float(i) for i in range(n)]
    assert groups2["tp"].last_x() == [[float(i) for i in range(n)]] * 2
    fut = groups2["dp"].dp_async(Batch({"x": torch.arange(n, dtype=torch.float32)}))
    assert get(fut)["y"].tolist() == [2.0 * i for i in range(n)]
    assert get([fut])[0] is fut.get()  # resolved once, cached


def test_disjoint_pools_run_concurrently(groups2, groups4):
    seconds = 1.5
    t0 = time.perf_counter()
    a = groups2["dp"].sleep_async(seconds)  # registered blocking=False
    b = groups4["dp"].sleep.future(seconds)  # registered blocking, made non-blocking for this call
    assert isinstance(b, Future)
    spans = a.get() + [(t0, t0 + seconds) for t0 in b.get()]
    wall = time.perf_counter() - t0
    assert wall < 1.6 * seconds, f"{wall:.2f}s: the two groups ran one after the other"
    latest_start = max(s for s, _ in spans)
    earliest_end = min(e for _, e in spans)
    assert latest_start < earliest_end  # every rank of both groups was sleeping at the same moment


def test_apply_runs_on_rank_zero_and_its_output_feeds_another_group(groups2, groups4):
    """Worker.apply (WHOLE_BATCH): the whole future to rank 0 only; its output, never fetched by the
    driver (tripwires), is sliced by a 2-rank consumer; the driver reads the published info and stamps."""
    n = 7
    fut = groups2["dp"].produce(
        Batch({"x": torch.arange(n, dtype=torch.float32)}), driver_pid=os.getpid(), payload=32768
    )
    whole = groups4["dp"].apply.future(publish_rows, fut)
    (call,) = whole.calls()  # one rank ran
    assert call.info == {"rows": n, "pid": groups4["dp"].pids[0]} and call.rows == n
    assert 0 <= call.end - call.start < 5
    out = groups2["tp"].consume_3d(whole)
    assert out["x"].tolist() == [float(i) for i in range(n)]
    with pytest.raises(Exception, match="driver deserialised"):
        whole.get()
