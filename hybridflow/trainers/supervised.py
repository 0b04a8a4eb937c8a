"""The training driver's side of `hybridflow train`'s supervisor (supervisor.py): what it reports up a
pipe, and what a restarted driver is told. Outside a supervised driver (the Python API, `cli.main([...])`
in a test) every function here is a no-op or returns its default.

Reports are single JSON lines (each write under PIPE_BUF, so atomic), merged by the supervisor into the
driver's latest state: `max_restarts`, `cluster` (the embedded cluster's gcs_server and raylet pids),
`checkpoint` (the last one written or loaded: where a restart resumes),
`restarts` (the driver's own restarts after a dead worker) and `closing` (the outcome's exit code, with
`lost`: the cluster processes gone by then), sent before the shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import sys

FD_ENV = "HYBRIDFLOW_SUPERVISOR_FD"
PID_ENV = "HYBRIDFLOW_SUPERVISOR_PID"
RESTARTS_ENV = "HYBRIDFLOW_RESTARTS"
RESUME_ENV = "HYBRIDFLOW_RESUME_FROM"
ENVS = (FD_ENV, PID_ENV, RESTARTS_ENV, RESUME_ENV)

_fd: int | None = None
_supervisor: int | None = None
_restarts = 0
_resume: str | None = None


def attach() -> None:
    """In the driver `hybridflow train` started: take the pipe and the restart facts out of the
    environment (Ray's processes inherit it, and must neither write the pipe nor count as restarted),
    and die with the supervisor (PR_SET_PDEATHSIG), whose death the run's reaper then answers."""
    global _fd, _supervisor, _restarts, _resume
    values = {k: os.environ.pop(k, None) for k in ENVS}
    if values[FD_ENV] is None:
        return
    _fd, _supervisor = int(values[FD_ENV]), int(values[PID_ENV] or 0)
    os.set_inheritable(_fd, False)
    _restarts, _resume = int(values[RESTARTS_ENV] or 0), values[RESUME_ENV]
    _die_with_parent()
    if os.getppid() != _supervisor:  # it died before the line above took effect
        os._exit(128 + signal.SIGKILL)


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def active() -> bool:
    return _fd is not None


def owner_pid() -> int:
    """The pid a user knows this run by: `hybridflow train`'s (the supervisor's) when supervised."""
    return _supervisor or os.getpid()


def restarts_before() -> int:
    """Restarts this run made before this driver started (each after a lost GCS or raylet)."""
    return _restarts


def resume_from() -> str | None:
    """trainer.resume of a restarted driver whose predecessor wrote or loaded a checkpoint: "auto"."""
    return _resume


def await_kill() -> None:
    """Wait for the supervisor to kill this process and all below it (it reported a lost cluster)."""
    import time

    while True:
        time.sleep(60)


def report(**fields) -> None:
    if _fd is None:
        return
    try:
        os.write(_fd, (json.dumps(fields) + "\n").encode())
    except OSError:  # the supervisor is gone: PR_SET_PDEATHSIG ends this process
        pass
