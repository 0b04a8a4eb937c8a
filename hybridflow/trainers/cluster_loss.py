"""A lost GCS or raylet of the embedded cluster at the end of a run: detected by pid, reported in one line,
and the run's processes killed without asking Ray. (Lost during training: ClusterLost, and
supervisor.py restarts the cluster.)

Why not `ray.shutdown()` then: with the GCS gone, killing actors and disconnecting wait on it, Ray's
client gives up after its reconnect timeout (60 s) and ends the process with exit 1 and its own C++
message, so a run whose steps and final checkpoint were all done would fail. The CLI prints its
outcome (the `done` line) before the shutdown and shuts down under `watch`: on a loss the run's
processes (ours: they run below this process) are SIGKILLed by pid and the process leaves with
os._exit and the outcome's exit code (Ray's atexit shutdown would wait on the GCS too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import ray

KINDS = ("gcs_server", "raylet")  # ray_constants.PROCESS_TYPE_GCS_SERVER / PROCESS_TYPE_RAYLET


class ClusterLost(Exception):
    """The embedded cluster's GCS or raylet went during training (the worker failures that follow are its
    effect, not a restartable fault of theirs): `hybridflow train`'s supervisor restarts the cluster."""

    def __init__(self, lost: list[str], step: int):
        super().__init__(
            f"the embedded Ray cluster lost its {', '.join(lost)} during step {step}; run the same command "
            "again to resume from the last checkpoint (trainer.resume=auto)"
        )


def cluster_pids() -> list[tuple[str, int]]:
    """(kind, pid) of the embedded cluster's GCS and raylet, for the supervisor to watch."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return []
    return [(kind, info.process.pid) for kind in KINDS for info in node.all_processes.get(kind, [])]


def lost_processes() -> list[str]:
    """'gcs_server (pid N)' for each process of the embedded cluster's GCS and raylet that has exited."""
    node = getattr(ray._private.worker, "_global_node", None)  # set by ray.init in this process
    if node is None:
        return []
    return [
        f"{kind} (pid {info.process.pid})"
        for kind in KINDS
        for info in node.all_processes.get(kind, [])
        if info.process.poll() is not None
    ]


@contextlib.contextmanager
def watch(rc: Callable[[], int], keep: set[int | None], poll_s: float = 0.2) -> Iterator[None]:
    """Around the part of the shutdown that asks the GCS (not ray.shutdown, which stops the GCS and
    raylet itself): when either is (or becomes) lost, `abandon` the cluster from a watcher thread (the
    main thread may be stuck in a call to the GCS) and leave with rc()."""
    done = threading.Event()

    def watcher() -> None:
        while not done.is_set():
            exit_if_lost(rc(), keep)
            done.wait(poll_s)

    thread = threading.Thread(target=watcher, name="hybridflow-cluster-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def exit_if_lost(rc: int, keep: set[int | None]) -> None:
    """A GCS or raylet lost: `abandon` the cluster and leave the process now with `rc`."""
    if lost := lost_processes():
        abandon(lost, keep)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def abandon(lost: list[str], keep: set[int | None]) -> None:
    """One line, then every process below this one (but `keep`: the reaper) SIGKILLed by pid."""
    from hybridflow.reaper import descendants

    print(
        f"hybridflow train: the embedded Ray cluster lost its {', '.join(lost)}; its processes were killed "
        "without a Ray shutdown",
        file=sys.stderr,
        flush=True,
    )
    for pid in descendants(os.getpid()):
        if pid not in keep:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
