"""Future: the result of a non-blocking group call (`@register(..., blocking=False)`).

A Future holds, per rank, two object refs: the output's row count and the output itself. `get()`
waits for every rank (reporting the first failure at once, even while other ranks still hang in a
collective), then fetches only the collected ranks' outputs. Passed as an argument to another
group's method, a Future of a sharded protocol is never fetched by the driver: each consumer rank
receives the refs and cuts out its own shard (process.FutureShard).

`calls()` gives each rank's CallInfo (output rows, busy interval, published info) without fetching
outputs; `observe_calls` lets the driver's phase timers see every call made inside a block.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from typing import Any

import ray

from hybridflow.controller.errors import WorkerDiedError, WorkerError, WorkerHungError, raise_worker_error
from hybridflow.controller.protocols import GroupView, ProtocolSpec


class Future:
    """Outputs of one call on a worker group, still in the object store."""

    def __init__(
        self,
        group_name: str,
        method: str,
        ranks: list[int],
        size_refs: list,
        out_refs: list,
        protocol: ProtocolSpec,
        view: GroupView,
        collect_ranks: list[int] | None,
    ):
        self.group_name, self.method = group_name, method
        self._ranks = ranks  # ranks the call ran on, aligned with size_refs / out_refs
        self._size_refs, self._out_refs = size_refs, out_refs
        self._protocol, self._view = protocol, view
        self._collect_ranks = collect_ranks  # sharded protocols: one rank per shard, in shard order
        self._done = False
        self._value: Any = None
        self.row_range: tuple[int, int] | None = None  # set by rows(): only these rows of the output

    def rows(self, lo: int, hi: int) -> Future:
        """Rows [lo, hi) of this (sharded) call's output, as a Future of its own: passed to another
        group's method, each consumer rank cuts its shard out of those rows only, and the driver still
        fetches nothing (trainers/sources/ahead.py scores part of a batch where it was generated)."""
        if not self.sharded:
            raise TypeError(f"{self!r}: only a sharded call's output has rows")
        view = copy.copy(self)
        base = self.row_range[0] if self.row_range else 0
        view.row_range, view._done, view._value = (base + lo, base + hi), False, None
        return view

    @property
    def sharded(self) -> bool:
        return self._collect_ranks is not None

    def collected_refs(self) -> tuple[list, list]:
        """(size refs, output refs) of the collected ranks in shard order (sharded futures only)."""
        pos = {r: i for i, r in enumerate(self._ranks)}
        idx = [pos[r] for r in self._collect_ranks]
        return [self._size_refs[i] for i in idx], [self._out_refs[i] for i in idx]

    def done(self) -> bool:
        ready, _ = ray.wait(list(self._size_refs), num_returns=len(self._size_refs), timeout=0)
        return len(ready) == len(self._size_refs)

    def wait(self) -> None:
        """Block until every rank finished; raise WorkerError / WorkerDiedError on the first failure."""
        try:
            wait_all(self._size_refs, self._ranks, self.group_name, self.method)
        except (WorkerError, WorkerDiedError) as e:
            # Mark the failed rank's output as seen, or Ray logs it again as an "unhandled error".
            ray.wait([self._out_refs[self._ranks.index(e.rank)]], timeout=0)
            try:
                ray.get(self._out_refs[self._ranks.index(e.rank)], timeout=0)
            except Exception:  # noqa: BLE001 — the same failure, already being raised
                pass
            raise

    def calls(self) -> list:
        """Each rank's CallInfo (process.py: rows, start/end stamps, info), in rank order; waits, and
        raises like wait() on a failure. Outputs stay in the object store."""
        return wait_all(self._size_refs, self._ranks, self.group_name, self.method)

    def busy_seconds(self) -> float:
        """The call's busy time: the slowest rank's run time of the method (waits like calls())."""
        return max(c.end - c.start for c in self.calls())

    def get(self):
        """The collected result (as the blocking call would have returned it)."""
        if not self._done:
            self.wait()
            if self.sharded:
                _, refs = self.collected_refs()
                outputs = ray.get(refs)
            else:
                got = dict(zip(self._ranks, ray.get(self._out_refs)))
                outputs = [got.get(r) for r in range(self._view.world_size)]
            self._value = self._protocol.collect(self._view, outputs)
            if self.row_range is not None:
                self._value = self._value.index(slice(*self.row_range))
            self._done = True
        return self._value

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"Future({self.group_name}.{self.method}, {state})"


# Bounded waits: Python runs a signal handler only between bytecodes, so the driver's main thread
# never blocks inside Ray for longer than this (a hung worker must not make the run unstoppable).
POLL_S = 0.5

_waiting: list[str] = []  # what the driver waits for, innermost last (named when a stop abandons it)
# Ray's wait runs Python signal handlers from C; an exception raised there surfaces as a SystemError.
# So a handler only notes an abandonment while in_ray_wait(), and a check run after each slice raises it.
_depth = 0
_checks: list[Callable[[], None]] = []


def in_ray_wait() -> bool:
    return _depth > 0


def add_wait_check(check: Callable[[], None]) -> None:
    """Run `check` after every wait slice from now on (it may raise, e.g. to abandon the step)."""
    _checks.append(check)


def remove_wait_check(check: Callable[[], None]) -> None:
    if check in _checks:
        _checks.remove(check)


_hang_timeout_s = 0.0


@contextlib.contextmanager
def hang_timeout(seconds: float):
    """Inside the block a wait in which no rank finishes for `seconds` raises WorkerHungError (0 = off)."""
    global _hang_timeout_s
    previous, _hang_timeout_s = _hang_timeout_s, seconds
    try:
        yield
    finally:
        _hang_timeout_s = previous


def waiting_for() -> str:
    """'group.method (ranks [..])' the driver is waiting for now, or ''."""
    return _waiting[-1] if _waiting else ""


def wait_all(refs: list, ranks: list[int], group: str, method: str) -> list:
    """ray.get(refs), but the first rank to fail is reported at once (others may be stuck in a
    collective waiting for it), as WorkerError / WorkerDiedError naming group, rank and method. Waits
    in slices of POLL_S so that stop signals are handled whatever the workers do."""
    pending = dict(zip(refs, ranks))
    progress = time.monotonic()
    global _depth
    while pending:
        _waiting.append(f"{group}.{method} (ranks {sorted(pending.values())})")
        _depth += 1
        try:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
        finally:
            _depth -= 1
            _waiting.pop()
        for check in _checks:
            check()
        if ready:
            progress = time.monotonic()
        elif _hang_timeout_s and time.monotonic() - progress >= _hang_timeout_s:
            raise WorkerHungError(group, sorted(pending.values()), method, _hang_timeout_s)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 — re-raised with group/rank/method
                raise_worker_error(e, group, rank, method)
    return ray.get(list(refs))


_OBSERVERS: list[Callable[[Future], None]] = []


@contextlib.contextmanager
def observe_calls(callback: Callable[[Future], None]):
    """Inside the block, every group call (blocking or not) is passed to `callback` as its Future
    when issued. Blocks nest: only the innermost observer sees a call (a phase inside a phase)."""
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def notify_observer(future: Future) -> None:
    if _OBSERVERS:
        _OBSERVERS[-1](future)


def get(x):
    """Resolve a Future (or a list / dict of them); anything else is returned unchanged."""
    if isinstance(x, Future):
        return x.get()
    if isinstance(x, (list, tuple)):
        return type(x)(get(v) for v in x)
    if isinstance(x, dict):
        return {k: get(v) for k, v in x.items()}
    return x
