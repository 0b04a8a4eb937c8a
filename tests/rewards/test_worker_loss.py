"""A reward worker lost to the outside world (SIGKILL, SIGSTOP), idle or busy, is replaced and its samples
in flight are scored on the fresh worker, once; a sample that takes its worker down twice is counted as
failed; a worker's output is capped and its tail kept. Real worker processes, really killed."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time

import numpy as np
import pytest

from hybridflow.rewards import RewardConfig, RewardExecutor
from hybridflow.rewards import pool as pool_module
from hybridflow.rewards.pool import SHOWN_BYTES, TAIL_BYTES

pytestmark = pytest.mark.timing  # real processes killed on a clock: run alone (Makefile)

REWARDS = textwrap.dedent(
    """
    import os, time
    from hybridflow.rewards import batched_reward

    def score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "loud":  # ~200 KB of prints
            for i in range(4000):
                print(f"line {i:05d} " + "x" * 40)
            print("LAST LINE")
        if solution_str == "slow":
            time.sleep(0.6)
        return float(solution_str.strip("slow") == ground_truth)

    @batched_reward
    def score_many(data_sources, solution_strs, ground_truths, extra_infos):
        if "die" in solution_strs:
            os._exit(9)  # a batched call runs in the worker itself: the worker dies, every time
        return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
    """
)


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "lossy_reward.py"
    path.write_text(REWARDS)
    return str(path)


def _pids(ex: RewardExecutor) -> list[int]:
    return [w.proc.pid for w in ex._pool.workers]


def _kill_and_wait(pid: int) -> None:
    """SIGKILL, then wait until it is a zombie (left for its parent, the pool, to reap): dead before the
    next batch is sent, so the pool meets a broken pipe, not an end of file it has read."""
    os.kill(pid, signal.SIGKILL)
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)


def test_an_idle_worker_killed_between_batches_is_replaced_and_the_batch_scored(reward_file):
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=2, chunk_size=1)
    with RewardExecutor(cfg) as ex:
        first = ex.score("src", ["a", "b"], ["a", "a"])
        killed = _pids(ex)[0]
        _kill_and_wait(killed)  # was: BrokenPipeError out of the pool's send, the run gone
        result = ex.score("src", ["a", "b", "a", "a"], ["a"] * 4)
        assert killed not in _pids(ex) and len(_pids(ex)) == 2
    np.testing.assert_array_equal(first.scores, [1, 0])
    np.testing.assert_array_equal(result.scores, [1, 0, 1, 1])
    assert result.errors == [] and result.metrics["reward/worker_restarts"] == 1


def test_a_busy_worker_killed_mid_batch_has_its_samples_scored_on_a_fresh_one(reward_file):
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=1, timeout_s=30.0)
    with RewardExecutor(cfg) as ex:
        victim = _pids(ex)[0]
        threading.Timer(
            0.3, os.kill, (victim, signal.SIGKILL)
        ).start()  # while the first "slow" sample sleeps
        result = ex.score("src", ["slow", "a", "b"], ["", "a", "a"])
    np.testing.assert_array_equal(result.scores, [1, 1, 0])
    assert result.errors == [] and result.metrics["reward/worker_restarts"] == 1


def test_a_stopped_worker_is_replaced_once_its_backstop_passes(reward_file, monkeypatch):
    monkeypatch.setattr(pool_module, "BACKSTOP_S", 0.5)
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=1, timeout_s=1.0)
    with RewardExecutor(cfg) as ex:
        os.kill(_pids(ex)[0], signal.SIGSTOP)  # idle, then silent: its samples go to a fresh worker
        result = ex.score("src", ["a", "b"], ["a", "a"])
    np.testing.assert_array_equal(result.scores, [1, 0])
    assert result.errors == [] and result.metrics["reward/worker_restarts"] == 1


def test_a_sample_that_kills_its_worker_twice_is_counted_failed_the_rest_scored(reward_file):
    cfg = RewardConfig(fn=f"{reward_file}:score_many", num_workers=2, chunk_size=2, on_error=-1.0,
                       max_error_fraction=1.0)  # fmt: skip
    with RewardExecutor(cfg) as ex:
        result = ex.score("src", ["a", "b", "die", "a"], ["a"] * 4)
        again = ex.score("src", ["a", "b"], ["a", "a"])
    np.testing.assert_array_equal(result.scores, [1, 0, -1, -1])
    assert [(e.index, e.kind) for e in result.errors] == [(2, "worker_died"), (3, "worker_died")]
    assert "exit code 9" in result.errors[0].message and "retry" in result.errors[0].message
    assert result.metrics["reward/worker_restarts"] == 2  # the first death, then the retry's
    np.testing.assert_array_equal(again.scores, [1, 0])


def test_a_workers_output_is_capped_and_its_tail_kept_in_the_output_dir(reward_file, tmp_path, capsys):
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=1)
    with RewardExecutor(cfg, output_dir=str(tmp_path)) as ex:
        pid = _pids(ex)[0]
        result = ex.score("src", ["loud", "a"], ["", "a"])
    np.testing.assert_array_equal(result.scores, [0, 1])
    err = capsys.readouterr().err
    assert "line 00000 xxx" in err and "LAST LINE" not in err  # was: all ~200 KB, in the run's log
    assert f"reward worker {pid}: output past 64 KiB is not shown" in err and len(err) < SHOWN_BYTES + 1024
    tail = (tmp_path / "reward_output" / f"worker-{pid}.log").read_bytes()
    assert len(tail) == TAIL_BYTES and tail.endswith(b"line 03999 " + b"x" * 40 + b"\nLAST LINE\n")
