"""hybridflow/reaper.py: a driver killed with SIGKILL leaves nothing running; a driver that exits
normally takes its reaper with it. Real processes, no Ray (the lifecycle tests run it under Ray)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.reaper import descendants

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)

ROOT = Path(__file__).resolve().parents[1]
DRIVER = """
import subprocess, sys, time
reaper = subprocess.Popen([sys.executable, "-m", "hybridflow.reaper", str(__import__("os").getpid())],
                          stdin=subprocess.PIPE, start_new_session=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(reaper.pid, child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_driver_leaves_nothing_running():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    reaper, child = map(int, driver.stdout.readline().split())
    time.sleep(1.5)  # the reaper has seen the child (it looks once a second)
    assert {reaper, child} <= set(descendants(driver.pid))
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 20
    while (_alive(child) or _alive(reaper)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child) and not _alive(reaper)
