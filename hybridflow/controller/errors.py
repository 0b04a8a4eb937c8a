"""Errors a worker group raises on the driver: which group, which rank, which method, and why.

Ray reports a failed actor task as RayTaskError (with the remote traceback) and a dead process as
ActorDiedError; both are re-raised here with the worker group's vocabulary so a user reading the
driver's traceback knows where to look.
"""

from __future__ import annotations

import re

import ray.exceptions

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerError(RuntimeError):
    """A worker method raised. `remote_traceback` is the worker-side traceback as text."""

    def __init__(self, group: str, rank: int, method: str, remote_traceback: str):
        self.group, self.rank, self.method, self.remote_traceback = group, rank, method, remote_traceback
        super().__init__(
            f"worker group {group!r}, rank {rank}, method {method!r} raised; remote traceback:\n{remote_traceback}"
        )


class WorkerDiedError(RuntimeError):
    """A worker process died (crash, OOM kill, os._exit) while running a method."""

    def __init__(self, group: str, rank: int, method: str, detail: str):
        self.group, self.rank, self.method = group, rank, method
        super().__init__(
            f"worker group {group!r}: the process of rank {rank} died during {method!r} "
            f"(the group is unusable; shut it down and rebuild it). Ray said: {detail}"
        )


class WorkerHungError(WorkerDiedError):
    """No rank finished a call for the hang timeout: treated as a dead process (its group is rebuilt)."""

    def __init__(self, group: str, ranks: list[int], method: str, seconds: float):
        RuntimeError.__init__(
            self,
            f"worker group {group!r}: rank {ranks[0]} (of waiting ranks {ranks}) made no progress in "
            f"{method!r} for {seconds:g} s (trainer.hang_timeout_s); treated as dead",
        )
        self.group, self.rank, self.method = group, ranks[0], method


def raise_worker_error(e: Exception, group: str, rank: int, method: str):
    """Re-raise a Ray failure from one rank as WorkerError / WorkerDiedError."""
    if isinstance(e, ray.exceptions.RayTaskError):
        text = getattr(e, "traceback_str", None) or str(e)
        raise WorkerError(group, rank, method, _ANSI.sub("", text).strip()) from e
    if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
        raise WorkerDiedError(
            group, rank, method, str(e).strip().splitlines()[0] if str(e) else repr(e)
        ) from e
    raise e
