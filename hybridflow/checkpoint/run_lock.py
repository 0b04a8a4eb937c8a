"""One run per run directory: an exclusive lock on `run_dir/.lock` holding the owner's pid and host.

Two runs writing one directory corrupt each other (the second resumes from the first's checkpoints
while they are written, both append to metrics.jsonl). `hybridflow train` takes this lock before it
starts any worker; a second run on the same directory stops with one line naming the holder. The
lock is an flock(2): the kernel drops it when the holder exits, however it exits, so a crashed run
never leaves a stale lock behind (the file and its last holder's text stay; they mean nothing once
unlocked). On network filesystems without flock support the lock is per host. See docs/operations.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from hybridflow.checkpoint.manager import CheckpointError

LOCK_FILE = ".lock"


class RunDirLocked(CheckpointError):
    """Another live process holds the run directory."""


class RunLock:
    """RunLock(run_dir): held from construction until release() (or process exit). pid: the owner named
    to a second run (`hybridflow train`'s own pid when it supervises this process)."""

    def __init__(self, run_dir: str | os.PathLike, pid: int | None = None):
        self.fd: int | None = None  # set before anything can fail: __del__ releases
        self.path = Path(run_dir) / LOCK_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:  # a file where a directory should be, read-only, no space...
            raise CheckpointError(
                f"trainer.output_dir: cannot create the run directory {self.path.parent} "
                f"({e.strerror or e}{f': {e.filename}' if e.filename else ''})"
            ) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(os.pread(self.fd, 4096, 0))
            os.close(self.fd)
            self.fd = None
            raise RunDirLocked(
                f"run directory {self.path.parent} is in use by {holder}; wait for that run to end or "
                "choose another trainer.experiment_name / trainer.output_dir"
            ) from None
        info = {
            "pid": pid or os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(info) + "\n").encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __del__(self):
        self.release()


def _describe(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode())
        return f"pid {info['pid']} on host {info['host']} (since {info['since']})"
    except (ValueError, KeyError, TypeError):
        return "another process (no owner recorded yet)"
