"""The sandboxed code tool against hostile code: each case contained, answered with one clear line, and
nothing of it left running. Limits small enough that the cases end in about a second each."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from hybridflow.agent.code_tool import run_python
from hybridflow.config.sandbox import SandboxConfig

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)

CFG = SandboxConfig(memory_mb=256, cpu_s=2.0, max_procs=16, file_size_mb=8)
SECRET = "HYBRIDFLOW_TEST_SECRET"


def _processes() -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit()}


def run(code: str, timeout_s: float = 6.0, cap: int = 4096):
    before = _processes()
    result = run_python(code, CFG, timeout_s, cap)
    # nothing it started is left: every process that appeared during the call is gone (others' processes
    # on a shared machine come and go; only our runner and `python -I main.py` count)
    left = [p for p in _processes() - before if _ours(p)]
    assert not left, f"left running: {left}"
    assert "\n" not in result.error, result.error
    return result


def _ours(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    # the code runs as `python -I main.py` in its own directory (Ray's agents run other `.../main.py`s)
    return b"_code_runner.py" in cmd or cmd.split(b"\0")[1:3] == [b"-I", b"main.py"]


def test_plain_code_runs_and_answers():
    r = run("print(6 * 7)")
    assert (r.output.strip(), r.exit_code, r.error) == ("42", 0, "")


def test_infinite_loop_is_stopped():
    r = run("while True:\n    pass")
    assert r.error.startswith("error:") and ("timeout" in r.error or "CPU seconds" in r.error)


def test_fork_bomb_is_contained():
    r = run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        timeout_s=3.0,
    )
    assert r.error.startswith("error:")


def test_10_gb_allocation_fails_inside():
    r = run("x = bytearray(10 * 2**30)\nprint('allocated')")
    assert "allocated" not in r.output and "memory_mb=256" in r.error


def test_writes_outside_its_directory_fail():
    target = os.path.join(os.path.dirname(__file__), "written_by_the_sandbox")
    r = run(f"open({target!r}, 'w').write('x')")
    assert not os.path.exists(target) and r.exit_code != 0
    if r.mode != "subreaper":  # namespaces: every mount read-only but its own directory
        assert "Read-only file system" in r.output
        assert run("open('mine.txt', 'w').write('x'); print(open('mine.txt').read())").output.strip() == "x"


def test_the_trainers_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv(SECRET, "hunter2")
    code = (f"import os\nprint(os.environ.get({SECRET!r}))\n"
            f"try:\n    print(open('/proc/{os.getpid()}/environ').read())\nexcept OSError as e:\n    print('no', e.errno)")  # fmt: skip
    r = run(code)
    assert "hunter2" not in r.output and r.output.startswith("None")


def test_100_mb_of_output_is_cut():
    r = run("import sys\nsys.stdout.write('x' * 100 * 2**20)", cap=4096)
    assert len(r.output) <= 4096 and "more than 4096 bytes" in r.error


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/net"), reason="no network namespaces on this OS")
def test_no_network_where_namespaces_are_allowed():
    r = run("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)\nprint('connected')")
    assert "connected" not in r.output


def test_without_namespaces_a_fork_bomb_is_still_contained():
    """sandbox.processes=subreaper: the path of a machine that allows no namespaces (rlimits, the pids
    cgroup as root, the session killed on timeout)."""
    cfg = dataclasses.replace(CFG, processes="subreaper")
    before = _processes()
    ok = run_python("print(6 * 7)", cfg, 6.0)
    assert (ok.output.strip(), ok.mode) == ("42", "subreaper")
    bomb = run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", cfg, 3.0
    )
    assert bomb.error.startswith("error:")
    time.sleep(0.5)  # orphans of the killed session reparent before they die
    assert not [p for p in _processes() - before if _ours(p)]
