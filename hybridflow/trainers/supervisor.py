"""`hybridflow train` as a thin supervisor above the training driver: a GCS or raylet of the embedded Ray
cluster lost mid-run is detected, reported in one line and recovered (docs/operations.md).

Why a process above the driver: the driver is a Ray client, and Ray ends it when its cluster goes. With
the raylet gone, Ray's core worker exits the process at once (exit 1, no Python cleanup, no line); with
the GCS gone, every call blocks for Ray's reconnect timeout (60 s) before the same exit. Neither can be
answered from inside. So `hybridflow train` runs the driver (`python -m hybridflow.trainers.cli`, the same
arguments) as its child and
- forwards each SIGTERM/SIGINT to it, one for one; the child has its own process group, so a terminal's
  Ctrl-C reaches it once, through here, and the driver's stop semantics are unchanged;
- reads what the driver reports (supervised.py): its cluster's pids, the last checkpoint it wrote or
  loaded, its own restarts, and its outcome once decided;
- on a loss (a GCS or raylet gone while the driver runs, before its outcome; the driver ended by Ray:
  exit 1 without an outcome; or the driver itself killed by a signal, its cluster with it): one line
  naming what died, every process below the driver SIGKILLed by pid, then a new
  driver with a fresh embedded cluster resuming from the newest checkpoint (trainer.resume=auto: that
  one, or a newer one its report had not yet announced), within trainer.max_restarts
  (shared with the driver's restarts after a dead worker);
- exits with the driver's exit code (128 + signal when a signal killed it).
Standard library only (as reaper.py): it starts at once and holds no Ray or torch state.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

from hybridflow.reaper import descendants
from hybridflow.trainers import supervised

POLL_S = 0.05
# a loss is acted on once it has lasted this long without the driver's outcome: a driver past its last
# Ray call (the final checkpoint written) reports it within that time and ends on its own (exit 0, `done`)
OUTCOME_GRACE_S = 2.0
GONE_TIMEOUT_S = 30.0
CLUSTER = "the embedded Ray cluster"


class Driver:
    """One training driver process and the state it reported."""

    def __init__(self, argv: list[str], restarts: int, checkpoint: str | None):
        read, write = os.pipe()
        env = {**os.environ, supervised.FD_ENV: str(write), supervised.PID_ENV: str(os.getpid()),
               supervised.RESTARTS_ENV: str(restarts)}  # fmt: skip
        if checkpoint:  # the newest valid one: never older than the last reported (a report can lag)
            env[supervised.RESUME_ENV] = "auto"
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        cmd = [sys.executable, "-m", "hybridflow.trainers.cli", *argv]
        self.proc = subprocess.Popen(cmd, env=env, pass_fds=(write,), **group)
        os.close(write)
        self.pipe, self.buffer = read, b""
        self.state: dict = {"restarts": restarts, "checkpoint": checkpoint}
        self.cluster: dict[int, tuple[str, str]] = {}  # pid -> (kind, start time)

    def read(self, timeout: float) -> bool:
        """Take in what the driver reported (waiting up to `timeout`); -> whether anything came."""
        ready, _, _ = select.select([self.pipe], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(self.pipe, 65536)
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            self.state.update(json.loads(line))
            if "cluster" in self.state and not self.cluster:
                self.cluster = {pid: (kind, start) for kind, pid in self.state["cluster"]
                                if (start := _start_time(pid)) is not None}  # fmt: skip
        if not chunk:  # end of file: the driver and everything holding the pipe are gone
            os.close(self.pipe)
            self.pipe = os.open(os.devnull, os.O_RDONLY)  # always readable, reads b""
        return bool(chunk)

    def lost(self) -> list[str]:
        """'raylet (pid N)' for each reported cluster process that has exited (or is a zombie)."""
        return [
            f"{kind} (pid {pid})" for pid, (kind, start) in self.cluster.items() if not _alive(pid, start)
        ]

    def loss(self) -> str | None:
        """While the driver runs: its cluster lost before its outcome, as a sentence's subject and verb
        (else None)."""
        closing = self.state.get("closing")
        if closing is None:
            return f"{CLUSTER} lost its {', '.join(lost)}" if (lost := self.lost()) else None
        if closing == 1 and self.state.get("lost"):
            return f"{CLUSTER} lost its {', '.join(self.state['lost'])}"
        return None

    def loss_at_exit(self, rc: int) -> str | None:
        """After the driver's exit with `rc`: what was lost, as a sentence's subject and verb (else None).
        A driver killed by a signal (the OOM killer, kill -9) takes its embedded cluster down with it: the
        driver is named, not the GCS and raylet that went after it."""
        if rc < 0 and "closing" not in self.state:
            return f"the driver (pid {self.proc.pid}) was killed by {signal.Signals(-rc).name}"
        if (found := self.loss()) is not None or "closing" in self.state:
            return found
        if self.cluster and rc == 1:  # Ray's core worker ended the driver
            gone = self.lost()
            return f"{CLUSTER} lost its {', '.join(gone) or 'GCS or raylet'} (Ray ended the driver, exit 1)"
        return None

    def kill_tree(self) -> None:
        """SIGKILL the driver and every process below it, by pid; wait until they are gone."""
        tree = {**descendants(self.proc.pid), self.proc.pid: _start_time(self.proc.pid)}
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        deadline = time.monotonic() + GONE_TIMEOUT_S
        while any(_alive(p, s) for p, s in tree.items()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        os.close(self.pipe)


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return None if fields is None else fields[19]


def _alive(pid: int, start: str | None) -> bool:
    """The process `pid` started at `start` still runs (a zombie or a recycled pid does not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and (start is None or fields[19] == start)


class Signals:
    """SIGTERM/SIGINT: forwarded to the running driver one for one; the first one is remembered."""

    def __init__(self):
        self.driver: Driver | None = None
        self.received: int | None = None

    def install(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        if self.driver is not None and self.driver.proc.poll() is None:
            os.kill(self.driver.proc.pid, signum)


def _say(line: str) -> None:
    print(f"hybridflow train: {line}", file=sys.stderr, flush=True)


def run_driver(driver: Driver) -> tuple[int | None, str | None]:
    """Until the driver exits or loses its cluster: -> (its exit code or None, the loss or None)."""
    since = None
    while True:
        driver.read(POLL_S)
        if (rc := driver.proc.poll()) is not None:
            while driver.read(0):  # its last reports
                pass
            return rc, driver.loss_at_exit(rc)
        if (found := driver.loss()) is None:
            since = None
        elif "closing" in driver.state:  # the driver's own report of the loss: nothing to wait for
            return None, found
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since >= OUTCOME_GRACE_S:
            return None, found


def supervise(argv: list[str]) -> int:
    """Run the training driver with `argv` until it ends without a cluster loss (or restarts run out)."""
    signals = Signals()
    signals.install()
    restarts, checkpoint = 0, None
    while True:
        driver = signals.driver = Driver(argv, restarts, checkpoint)
        if signals.received:  # a signal between the last check and the start: it is this driver's
            os.kill(driver.proc.pid, signals.received)
        rc, loss = run_driver(driver)
        if loss is None:
            return rc if rc >= 0 else 128 - rc
        driver.kill_tree()
        signals.driver = None
        state = driver.state
        restarts, limit = int(state.get("restarts", restarts)) + 1, int(state.get("max_restarts", 0))
        what = loss
        if signals.received:
            _say(
                f"{what} after {signal.Signals(signals.received).name}; latest checkpoint: {state['checkpoint']}"
            )
            return 128 + signals.received
        if restarts > limit:
            _say(f"failed after {restarts - 1} restarts: {what}; latest checkpoint: {state['checkpoint']}")
            return 1
        checkpoint = state.get("checkpoint")
        start = (
            "resumes from the newest checkpoint" if checkpoint else "starts the run again (no checkpoint yet)"
        )
        _say(f"restart {restarts}/{limit}: {what} during training; a new cluster {start}")


def main(argv: list[str]) -> int:
    return supervise(argv)
