"""Reward code runs only in reward worker processes (real processes, no mocks): a module that exits,
raises or hangs at import is a one-line error; hanging samples time out concurrently; scores are
checked as float32 and against max_abs_score; a mostly failing batch stops; workers die with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hybridflow.errors import RunStopped, UserError
from hybridflow.rewards import RewardConfig, RewardExecutor, RewardFailureError, RewardSpecError
from hybridflow.rewards.executor import timeout_waits
from hybridflow.rewards.pool import WORKDIR_PREFIX, locked_workdir, sweep_orphaned_workdirs

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)

REWARDS = textwrap.dedent(
    """
    import os, time
    open(os.environ["IMPORT_LOG"], "a").write(f"{os.getpid()}\\n")

    def score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(120)
        if solution_str == "huge":
            return 1e300
        if solution_str == "big":
            return 1e30
        return float(solution_str == ground_truth)
    """
)


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    monkeypatch.setenv("IMPORT_LOG", str(tmp_path / "imports.log"))
    path = tmp_path / "isolated_reward.py"
    path.write_text(REWARDS)
    return path


def test_user_module_is_imported_only_in_the_workers(reward_file):
    with RewardExecutor(RewardConfig(fn=f"{reward_file}:score", num_workers=2)) as ex:
        assert ex.fn is None and not ex.batched
        result = ex.score("src", ["a", "b"], ["a", "a"])
    np.testing.assert_array_equal(result.scores, [1, 0])
    importers = {int(x) for x in Path(os.environ["IMPORT_LOG"]).read_text().split()}
    assert len(importers) == 2 and os.getpid() not in importers
    assert not [m for m in sys.modules if m.startswith("hybridflow_user_reward_")]


def test_preloaded_modules_are_imported_before_the_first_samples_timeout(reward_file, tmp_path, monkeypatch):
    """A library the reward imports on first use (reasoning_gym: seconds) fails every first sample inside
    timeout_s unless reward.preload imports it at start-up; resolve_config adds reasoning_gym itself."""
    # the import takes twice timeout_s: a first sample always times out; preloaded, a sample is a compare
    (tmp_path / "slow_library.py").write_text("import time\ntime.sleep(4)\n")
    lazy = tmp_path / "lazy_reward.py"
    lazy.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    import slow_library\n    return float(solution_str == ground_truth)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    base = dict(fn=f"{lazy}:score", num_workers=1, timeout_s=2.0, max_error_fraction=1.0, error_score=-1)
    with RewardExecutor(RewardConfig(**base)) as ex:
        assert ex.score("src", ["a"], ["a"]).scores.tolist() == [-1]
    with RewardExecutor(RewardConfig(**base, preload=["slow_library"])) as ex:
        assert ex.score("src", ["a", "b"], ["a", "a"]).scores.tolist() == [1, 0]

    from hybridflow.config import HybridFlowConfig
    from hybridflow.config.validate import resolve_config

    cfg = HybridFlowConfig()
    cfg.data.dataset = "reasoning_gym:chain_sum"
    assert resolve_config(cfg).reward.preload == ["reasoning_gym"]


def test_a_reward_worker_does_not_import_torch():
    """What a worker imports (rewards/_worker.py + registry.py): light, so workers start and fork fast."""
    code = (
        "import sys, hybridflow.rewards._worker, hybridflow.rewards.registry; print('torch' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.parametrize(
    "source, expected, startup_s",
    [  # a module that fails does so at once: its wait is only a bound; the hang is waited for in full
        ("import sys\nsys.exit(5)\n", "importing it called sys.exit(5) (bad.py:2)", 60),
        ("import os\nos._exit(7)\n", "the reward worker exited with code 7 while importing it", 60),
        ("def f(:\n", "SyntaxError", 60),
        ("import time\ntime.sleep(300)\n", "did not finish importing it within 3s", 3),
    ],
)
def test_a_module_that_exits_fails_or_hangs_at_import_is_one_line(tmp_path, source, expected, startup_s):
    path = tmp_path / "bad.py"
    path.write_text(source)
    start = time.monotonic()
    with pytest.raises(RewardSpecError) as info:
        # 60 s: a worker's own start-up (Python, numpy) must fit inside it on a loaded 2-core CI machine;
        # the hanging module never finishes, so its 3 s give the same outcome however slow the start-up
        RewardExecutor(RewardConfig(fn=f"{path}:score", startup_timeout_s=startup_s))
    assert time.monotonic() - start < 90  # the hang costs startup_timeout_s, not forever
    message = str(info.value)
    assert expected in message and "\n" not in message and isinstance(info.value, UserError)
    assert message.startswith(f"reward.fn='{path}:score': ")


def test_hanging_samples_time_out_concurrently(reward_file):
    """12 hanging samples on one worker: all 12 reported after one timeout_s, not one after another
    (a sample slower than timeout_s / 10 hands the rest of the batch to processes of their own, so
    every hanging sample starts within the first one's timeout), the good ones scored."""
    n_hang, timeout = 12, 2.0
    responses = ["hang"] * n_hang + ["a", "b"] * 3
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=1, timeout_s=timeout, max_error_fraction=1.0)
    with RewardExecutor(cfg) as ex:
        start = time.monotonic()
        result = ex.score("src", responses, ["a"] * len(responses))
        elapsed = time.monotonic() - start
        again = ex.score("src", ["a", "b"], ["a", "a"])  # the pool is healthy afterwards
    assert [e.index for e in result.errors if e.kind == "timeout"] == list(range(n_hang))
    assert result.metrics["reward/num_timeouts"] == n_hang
    assert result.metrics["reward/timeout_waits"] == 1  # was 2: the first timeout waited out alone
    np.testing.assert_array_equal(result.scores[n_hang:], [1, 0] * 3)
    # sequential timeouts would take >= 24 s; concurrent ones ~timeout (+ process starts on a busy CI box)
    assert elapsed < n_hang * timeout / 2, elapsed
    np.testing.assert_array_equal(again.scores, [1, 0])
    assert again.metrics["reward/timeout_waits"] == 0


def test_a_batch_that_all_hangs_waits_one_timeout(reward_file):
    """Every sample hangs, 2 workers, 4 chunks each: one timeout_s waited (the executor's count), all
    scored per on_error; the next batch is scored by the same, healthy pool."""
    cfg = RewardConfig(fn=f"{reward_file}:score", num_workers=2, timeout_s=2.0, max_error_fraction=1.0)
    with RewardExecutor(cfg) as ex:
        result = ex.score("src", ["hang"] * 16, ["a"] * 16)
        again = ex.score("src", ["a", "b", "a"], ["a"] * 3)
    assert sorted(e.index for e in result.errors) == list(range(16))
    assert {e.kind for e in result.errors} == {"timeout"}
    assert result.metrics["reward/timeout_waits"] == 1 and result.metrics["reward/num_timeouts"] == 16
    np.testing.assert_array_equal(result.scores, np.zeros(16))
    np.testing.assert_array_equal(again.scores, [1, 0, 1])


def test_a_batched_call_that_hangs_is_killed_after_one_timeout(tmp_path):
    """reward.timeout_s holds per call of a batched function, not per sample of its chunk: a call on 8
    samples that hangs is killed after timeout_s, its samples timed out, and the pool scores again."""
    path = tmp_path / "batched_reward.py"
    path.write_text(textwrap.dedent(
        """
        import time
        from hybridflow.rewards import batched_reward

        @batched_reward
        def score(data_sources, solution_strs, ground_truths, extra_infos=None):
            if "hang" in solution_strs:
                time.sleep(120)
            return [float(s == g) for s, g in zip(solution_strs, ground_truths)]
        """
    ))  # fmt: skip
    timeout = 2.0
    cfg = RewardConfig(fn=f"{path}:score", num_workers=1, timeout_s=timeout, max_error_fraction=1.0)
    with RewardExecutor(cfg) as ex:
        assert ex.batched
        start = time.monotonic()
        result = ex.score("src", ["hang"] * 8, ["a"] * 8)
        elapsed = time.monotonic() - start
        again = ex.score("src", ["a", "b"], ["a", "a"])
    assert sorted(e.index for e in result.errors) == list(range(8)) and {e.kind for e in result.errors} == {
        "timeout"
    }
    assert f"within {timeout:g}s" in result.errors[0].message
    # per sample (8 x 2 s) plus the 10 s backstop would be 26 s; one call's timeout is 2 s (+ a restart)
    assert elapsed < 4 * timeout, elapsed
    np.testing.assert_array_equal(again.scores, [1, 0])


def test_timeout_waits_counts_waits_one_after_another():
    assert timeout_waits([], 2.0) == 0
    assert timeout_waits([10.0, 10.1, 11.9], 2.0) == 1  # all started within the first one's 2 s
    assert timeout_waits([10.0, 12.0, 12.5, 14.1], 2.0) == 3  # 12.0 starts as 10.0 times out
    assert timeout_waits([14.1, 10.0, 12.5, 12.0], 2.0) == 3  # order does not matter


def test_scores_are_checked_as_float32_and_against_the_bound(reward_file):
    cfg = RewardConfig(fn=f"{reward_file}:score", max_abs_score=1e6, max_error_fraction=1.0, error_score=-1)
    with RewardExecutor(cfg) as ex:
        result = ex.score("src", ["huge", "big", "a"], ["a"] * 3)
    np.testing.assert_array_equal(result.scores, [-1, -1, 1])
    kinds = [(e.index, e.kind) for e in result.errors]
    assert kinds == [(0, "exception"), (1, "bad_score")]  # 1e300 fails in the worker, 1e30 on the bound
    assert "not finite as float32" in result.errors[0].message
    assert "exceeds reward.max_abs_score=1e+06" in result.errors[1].message
    assert result.metrics["reward/error_fraction"] == pytest.approx(2 / 3)


def test_more_failures_than_max_error_fraction_stop_in_one_line(reward_file):
    with RewardExecutor(RewardConfig(fn=f"{reward_file}:score", max_error_fraction=0.5)) as ex:
        ok = ex.score("src", ["big", "a"], ["a", "a"])  # 1 of 2: not more than half
        assert len(ok.errors) == 1
        with pytest.raises(RewardFailureError) as info:
            ex.score("src", ["big", "big", "a"], ["a"] * 3, sample_ids=["p", "q", "r"])
    message = str(info.value)
    assert isinstance(info.value, RunStopped) and "\n" not in message
    assert "failed on 2 of 3 samples (0 timeouts); first: sample p (bad_score)" in message
    assert "reward.max_error_fraction=0.5" in message


PARENT = textwrap.dedent(
    """
    import sys, time
    from hybridflow.rewards import RewardConfig, RewardExecutor
    ex = RewardExecutor(RewardConfig(fn=sys.argv[1], num_workers=2, timeout_s=1.0, max_error_fraction=1.0))
    print("ready", flush=True)
    ex.score("src", ["hang"] * 6, ["a"] * 6)   # hangs: 1 s, then forked children that hang too
    time.sleep(600)
    """
)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_and_their_hung_children_die_with_the_parent(reward_file, tmp_path):
    """...and the working directories they could not remove are swept by the next pool, a live one's kept."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), TMPDIR=str(tmp))
    parent = subprocess.Popen(
        [sys.executable, str(script), f"{reward_file}:score"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert parent.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30  # wait until a worker has forked hanging children
        while time.monotonic() < deadline and len(_descendants(parent.pid)) < 4:
            time.sleep(0.2)
        procs = _descendants(parent.pid)
        assert len(procs) >= 4, procs  # 2 workers + forked children
    finally:
        parent.send_signal(signal.SIGKILL)  # no cleanup code runs in the parent
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.2)
    assert not [p for p in procs if _alive(p)]
    orphaned = sorted(tmp.glob(WORKDIR_PREFIX + "*"))
    assert len(orphaned) == 2, orphaned  # one per worker, left behind by the kill
    live, fd = locked_workdir(str(tmp))
    try:
        assert sweep_orphaned_workdirs(str(tmp)) == 2
        assert sorted(tmp.iterdir()) == [Path(live)]
    finally:
        os.close(fd)
