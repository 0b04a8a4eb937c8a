"""Kills what a run started when the run itself is killed without a chance to clean up (SIGKILL, the OOM
killer): `python -m hybridflow.reaper DRIVER_PID`, started by the driver with a pipe on its stdin.

Ray's node processes exit soon after their driver, but its agents linger for a minute or more; worker
processes of other kinds (reward pools) may never notice. The reaper records, once a second, every
process below the driver (pid + start time, so a recycled pid is never mistaken for one of them); when
its stdin reaches end of file (the driver exited, however) it SIGKILLs those still alive. It runs in its
own session, so a Ctrl-C sent to the run's process group does not stop it. See docs/operations.md.
Standard library only: it must start fast and not import torch or Ray.
"""

from __future__ import annotations

import os
import select
import signal
import sys


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, start time) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[19]


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below `root`."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(entry)) is not None:
            children.setdefault(st[0], []).append((int(entry), st[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def main(driver: int) -> None:
    known: dict[int, str] = {}
    me = os.getpid()
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # end of file: the driver is gone
        known.update({p: s for p, s in descendants(driver).items() if p != me})
    for pid, start in known.items():
        st = _stat(str(pid))
        if st is not None and st[1] == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


if __name__ == "__main__":
    main(int(sys.argv[1]))
