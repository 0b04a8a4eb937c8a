"""Hostile reward code against the sandbox of the reward workers (rewards/sandbox.py), with real
worker processes: nothing it starts outlives its worker or the sweep, a 10 GiB allocation fails in
one line naming the limit, CPU time, file size and process count are bounded, it runs in a temporary
directory of its own."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import time

import pytest

from hybridflow.config.sandbox import SandboxConfig, sandbox_errors
from hybridflow.rewards import RewardConfig, RewardExecutor

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)

HOSTILE = textwrap.dedent(
    """
    import os

    def _sleeper(tag):
        try:
            os.execvp("sleep", ["sleep", tag])
        finally:
            os._exit(1)

    def score(data_source, solution_str, ground_truth, extra_info=None):
        tag = ground_truth  # a unique sleep duration: how the test finds what was left running
        if solution_str == "double_fork":
            if os.fork() == 0:
                os.setsid()
                r, w = os.pipe()  # close-on-exec: EOF once the grandchild runs `sleep` (found by its tag)
                if os.fork() == 0:
                    _sleeper(tag)
                os.close(w)
                os.read(r, 1)
                os._exit(0)
            os.wait()
            return 1.0
        if solution_str == "alloc":
            return float(len(bytearray(10 << 30)))
        if solution_str == "loop":
            while True:
                pass
        if solution_str == "bomb":  # bounded, so that a missing limit cannot take the machine down
            n = 0
            for _ in range(300):
                try:
                    pid = os.fork()
                except OSError:
                    break
                if pid == 0:
                    _sleeper(tag)
                n += 1
            return float(n)
        if solution_str == "big_file":
            with open("big.bin", "wb") as f:
                f.write(b"x" * (3 << 20))
            return 1.0
        if solution_str == "where":
            open(os.environ["WHERE_LOG"], "w").write(os.getcwd() + "\\n" + os.environ["TMPDIR"])
            return 1.0
        return 0.0
    """
)


@pytest.fixture
def hostile(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    return f"{path}:score"


def _tag() -> str:
    return f"{300 + random.random():.9f}"


def _running(tag: str) -> list[int]:
    """Live (not zombie) processes whose command line holds `tag`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if tag in cmd.split("\0") and state != "Z":
            found.append(int(pid))
    return found


def _gone_within(tag: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(tag)


def _can_unshare_pid() -> bool:
    """Whether this machine lets a process make a PID namespace (root or CAP_SYS_ADMIN, and a container
    that allows it): then `auto` must take it. Probed in a child, since unshare changes the caller."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


def _cfg(fn: str, **sandbox) -> RewardConfig:
    return RewardConfig(fn=fn, num_workers=1, max_error_fraction=1.0, sandbox=SandboxConfig(**sandbox))


@pytest.mark.parametrize("processes", ["auto", "subreaper"])
def test_a_setsid_double_fork_is_killed_during_the_run_and_nothing_outlives_it(hostile, processes):
    tag = _tag()
    with RewardExecutor(_cfg(hostile, processes=processes)) as ex:
        result = ex.score("src", ["double_fork"], [tag])
        assert result.scores.tolist() == [1.0]
        expected = "pid_namespace" if processes == "auto" and _can_unshare_pid() else "subreaper"
        assert ex._pool.workers[0].containment == expected
        # the orphan left its process group, so no timeout kill reaches it: the sweep (every 0.5 s) does
        assert _gone_within(tag, 5.0), [open(f"/proc/{p}/stat").read()[:60] for p in _running(tag)]
        ex.score("src", ["double_fork"], [tag])  # one more, left for the shutdown to find
    assert _gone_within(tag, 3.0)


def test_a_10_gib_allocation_fails_in_one_line_naming_the_limit(hostile):
    with RewardExecutor(_cfg(hostile, memory_mb=512)) as ex:
        result = ex.score("src", ["alloc", "x"], ["t", "t"])
    assert [e.index for e in result.errors] == [0]
    message = result.errors[0].message
    assert "\n" not in message and "reward.sandbox.memory_mb=512" in message, message


def test_an_infinite_loop_is_killed_by_the_timeout(hostile):
    start = time.monotonic()
    with RewardExecutor(RewardConfig(fn=hostile, num_workers=1, timeout_s=1.0, max_error_fraction=1.0)) as ex:
        result = ex.score("src", ["loop"], ["t"])
    assert [e.kind for e in result.errors] == ["timeout"]
    assert time.monotonic() - start < 30


def test_cpu_seconds_are_limited_per_sample(hostile):
    """timeout_s far away: the process is killed by RLIMIT_CPU (cpu_s=1), in one line."""
    cfg = _cfg(hostile, cpu_s=1.0)
    cfg.timeout_s = 60.0
    start = time.monotonic()
    with RewardExecutor(cfg) as ex:
        result = ex.score("src", ["loop"], ["t"])
    assert [e.kind for e in result.errors] == ["worker_died"]
    assert "reward.sandbox.cpu_s=1 CPU seconds" in result.errors[0].message
    assert time.monotonic() - start < 30


def test_a_fork_bomb_is_contained_and_cleaned_up(hostile):
    tag = _tag()
    with RewardExecutor(_cfg(hostile, max_procs=16)) as ex:
        result = ex.score("src", ["bomb"], [tag])
    # the sample's own process counts against the 16: at most 15 children started
    assert 0 < result.scores[0] < 16, result.scores
    assert _gone_within(tag, 5.0), _running(tag)


def test_file_size_is_limited_in_one_line(hostile):
    with RewardExecutor(_cfg(hostile, file_size_mb=1)) as ex:
        result = ex.score("src", ["big_file"], ["t"])
    assert "reward.sandbox.file_size_mb=1 (RLIMIT_FSIZE)" in result.errors[0].message


def test_reward_code_runs_in_its_own_temporary_directory_removed_after(hostile, tmp_path, monkeypatch):
    log = tmp_path / "where.log"
    monkeypatch.setenv("WHERE_LOG", str(log))
    with RewardExecutor(_cfg(hostile)) as ex:
        ex.score("src", ["where"], ["t"])
    cwd, tmpdir = log.read_text().splitlines()
    assert os.path.realpath(cwd) == os.path.realpath(tmpdir) and "hybridflow-reward-" in cwd
    assert not os.path.exists(cwd)


def test_bad_sandbox_values_are_one_line_each():
    assert sandbox_errors(SandboxConfig(memory_mb=0, cpu_s=float("nan"))) == [
        "reward.sandbox.memory_mb: must be in [1, 4398046511104], got 0",
        "reward.sandbox.cpu_s: must be in (0, 1000000000], got nan",
    ]


def test_empty_cgroups_of_dead_workers_are_removed_by_the_next_worker(hostile):
    from hybridflow.rewards.sandbox import CGROUP_PREFIX, cgroup_dir

    probe = cgroup_dir(1)
    if probe is None or os.geteuid() != 0:
        pytest.skip("no writable pids cgroup here")
    stale = os.path.join(os.path.dirname(probe), f"{CGROUP_PREFIX}{2**22 + 7}")  # above pid_max: never alive
    os.mkdir(stale)  # what a worker SIGKILLed with its trainer leaves behind
    with RewardExecutor(_cfg(hostile)) as ex:
        ex.score("src", ["x"], ["t"])
    assert not os.path.exists(stale)
