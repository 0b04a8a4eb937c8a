"""The driver's per-step timers: its own elapsed seconds per name, and per phase of the dataflow the busy
time of the worker-group calls issued inside it (docs/metrics.md). The trainer logs them as timing_s/*
(trainers/metrics.py); the planner's calibration times an empty step through them (planner/microbench_path.py)."""

from __future__ import annotations

import contextlib
import time

from hybridflow.controller.future import observe_calls


class Timers:
    """Per-step timing. `with timers("step"): ...` adds the driver's elapsed seconds to timing_s/step.

    `with timers.phase("values"): ...` times a phase of the dataflow (docs/metrics.md): every worker
    group call issued inside the block is attributed to it, and timing_s/values becomes the workers'
    own busy time (per call the max over ranks of the method's run time, summed over the calls),
    with the busy interval (earliest start, latest end) kept for timing_s/timeline/ and the overlap
    sections; a phase that issued no call reports the driver's wall time instead (a rule reward in the
    driver), unless calls were issued under its name earlier in the step (chained on the generation:
    trainers/sources/base.py chain_on_rollout), whose busy time is then all of it. Calls are
    non-blocking, so these figures are read in `collect()`, after the step. `wait_each_phase` makes
    every phase wait for its calls (the sequential baseline).
    """

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.spans: dict[str, list[float]] = {}  # phase -> [start, end], wall clock
        self.wait_each_phase = False
        self._calls: list = []  # (phase, Future), in issue order
        self._in_driver: set[str] = set()
        # the last popped step's phases that ran in the driver (trainers/plan_metrics.py reads them)
        self.driver_phases: frozenset[str] = frozenset()

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            key = f"timing_s/{name}"
            self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - start

    @contextlib.contextmanager
    def phase(self, name: str):
        mine: list = []
        start = time.time()
        with observe_calls(mine.append):
            yield
        if self.wait_each_phase:
            for fut in mine:
                fut.wait()
        if mine:
            self._calls.extend((name, f) for f in mine)
        elif any(phase == name for phase, _ in self._calls):
            pass  # its calls were issued earlier (chained on the generation): their busy time is its own
        else:  # run in the driver
            self._in_driver.add(name)
            self._add(name, start, time.time(), time.time() - start)

    def _add(self, name: str, start: float, end: float, seconds: float) -> None:
        key = f"timing_s/{name}"
        self.times[key] = self.times.get(key, 0.0) + seconds
        span = self.spans.setdefault(name, [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)

    def collect(self, sections: dict[str, tuple[str, ...]] | None = None) -> None:
        """Wait for this step's phase calls (in issue order, so the first failure reported is the
        producer's, not that of a consumer waiting for it) and add their busy times, the phases'
        timelines and timing_s/overlap/<section> (the wall time of each section that ran two or more
        of its phases: latest end - earliest start)."""
        calls, self._calls = self._calls, []
        for name, fut in calls:
            ranks = fut.calls()
            self._add(name, min(c.start for c in ranks), max(c.end for c in ranks), fut.busy_seconds())
        if not self.spans:
            return
        t0 = min(s for s, _ in self.spans.values())
        for name, (start, end) in self.spans.items():
            self.times[f"timing_s/timeline/{name}/start"], self.times[f"timing_s/timeline/{name}/end"] = (
                start - t0,
                end - t0,
            )
        for section, phases in (sections or {}).items():
            spans = [self.spans[p] for p in phases if p in self.spans]
            if len(spans) >= 2:
                wall = max(e for _, e in spans) - min(s for s, _ in spans)
                self.times[f"timing_s/overlap/{section}"] = wall
        self.spans = {}

    def pop(self) -> dict[str, float]:
        """This step's times; calls not collected (a step that failed before its end) are dropped."""
        self._calls, self.spans = [], {}
        self.driver_phases, self._in_driver = frozenset(self._in_driver), set()
        out, self.times = self.times, {}
        return out
