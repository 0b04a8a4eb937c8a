"""Fault kinds of benchmarks/chaos.py beyond a killed worker: a hung worker (SIGSTOP, caught by
trainer.hang_timeout_s), the raylet and the GCS each killed mid-run (recovered by `hybridflow train`'s
supervisor with a new embedded cluster), the GCS killed after the last checkpoint, and the newest
checkpoint's manifest deleted before a resume. One real `hybridflow train` run per kind (the
config of chaos.py); reported: exit code, steps done, restarts, steps lost beyond the last checkpoint
before the fault, and the time to recover (MTTR: from the fault to the `resumed from step` line, or to
the exit for the GCS kind)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from tests.trainers.lifecycle_helpers import (
    cmdline,
    descendants,
    metric_rows,
    start_train,
    wait_for,
    worker_pids,
)

FAULT_AFTER = (
    3  # the fault is injected once this step's metrics row is written (step 2's checkpoint is the last)
)


def _after_row(run: Path, step: int, proc) -> None:
    wait_for(lambda: any(r["step"] == step for r in metric_rows(run)), proc, poll=0.01)


def _node_process(proc, name: str) -> int:
    return next(p for p in descendants(proc.pid) if cmdline(p).split(" ")[0].endswith(name))


def _time_to_line(log: Path, pattern: str, proc, since: float) -> float | None:
    """Seconds from `since` until a line matching `pattern` is in `log` (None if the run ends first)."""
    while not re.search(pattern, log.read_text()):
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return time.monotonic() - since


def _finish(proc, log: Path, run: Path, steps: int, save_every: int, mttr, fault_step: int | None) -> dict:
    rc = proc.wait(timeout=1800)
    text = log.read_text()
    done = sorted({r["step"] for r in metric_rows(run)})
    resumed = [int(x) for x in re.findall(r"resumed from step (\d+)", text)]
    last_ckpt = None if fault_step is None else fault_step // save_every * save_every
    lost = last_ckpt - resumed[-1] if resumed and last_ckpt is not None else 0 if rc == 0 else "-"
    return {
        "rc": rc,
        "done": done[-1] if done else 0,
        "complete": rc == 0 and done == list(range(steps + 1)),
        "restarts": text.count("hybridflow train: restart "),
        "lost": lost,
        "mttr_s": mttr,
        "last_line": ([x for x in text.splitlines() if x.startswith("hybridflow train:")] or [""])[-1],
    }


def hung_worker(config: Path, steps: int, save_every: int) -> dict:
    run, log = config.parent / "hung", config.parent / "hung.log"
    proc = start_train(config, "trainer.experiment_name=hung", "trainer.hang_timeout_s=10", log=log)
    _after_row(run, FAULT_AFTER, proc)
    os.kill(min(worker_pids(proc.pid)), signal.SIGSTOP)
    mttr = _time_to_line(log, r"resumed from step \d+ \(restart", proc, time.monotonic())
    return _finish(proc, log, run, steps, save_every, mttr, FAULT_AFTER)


def node_process_kill(kind: str):
    """The embedded cluster's `kind` process (raylet, gcs_server) SIGKILLed mid-run."""

    def inject(config: Path, steps: int, save_every: int) -> dict:
        run, log = config.parent / kind, config.parent / f"{kind}.log"
        proc = start_train(config, f"trainer.experiment_name={kind}", log=log)
        _after_row(run, FAULT_AFTER, proc)
        os.kill(_node_process(proc, kind), signal.SIGKILL)
        mttr = _time_to_line(log, r"resumed from step \d+ \(restart", proc, time.monotonic())
        return _finish(proc, log, run, steps, save_every, mttr, FAULT_AFTER)

    return inject


def gcs_after_last_checkpoint(config: Path, steps: int, save_every: int) -> dict:
    run, log = config.parent / "gcs", config.parent / "gcs.log"
    proc = start_train(config, "trainer.experiment_name=gcs", log=log)
    latest = run / "checkpoints" / "latest"
    wait_for(lambda: latest.exists() and latest.read_text().strip() == f"step_{steps}", proc, poll=0.005)
    os.kill(_node_process(proc, "gcs_server"), signal.SIGKILL)
    start = time.monotonic()
    proc.wait(timeout=600)
    return _finish(proc, log, run, steps, save_every, time.monotonic() - start, None)


def manifest_deleted(config: Path, steps: int, save_every: int) -> dict:
    """A finished run whose newest checkpoint lost its manifest, resumed with a longer total_steps."""
    run, log = config.parent / "manifest", config.parent / "manifest.log"
    first = start_train(config, "trainer.experiment_name=manifest", log=config.parent / "manifest0.log")
    assert first.wait(timeout=1800) == 0, "the run before the manifest deletion failed"
    (run / "checkpoints" / f"step_{steps}" / "manifest.json").unlink()
    start = time.monotonic()
    proc = start_train(config, "trainer.experiment_name=manifest", log=log)
    mttr = _time_to_line(log, r"resumed from step \d+", proc, start)
    return _finish(proc, log, run, steps, save_every, mttr, steps - save_every)  # the newest valid one


KINDS = {
    "hung worker (SIGSTOP, hang_timeout_s=10)": hung_worker,
    "raylet killed mid-run": node_process_kill("raylet"),
    "GCS killed mid-run": node_process_kill("gcs_server"),
    "GCS killed after the last checkpoint": gcs_after_last_checkpoint,
    "newest manifest deleted, then resume=auto": manifest_deleted,
}


def report(config: Path, steps: int, save_every: int) -> dict:
    print()
    print(f"| fault (after step {FAULT_AFTER}) | exit code | steps done | completed | restarts | lost beyond last checkpoint | MTTR s | last line |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    totals = {}
    for name, inject in KINDS.items():
        r = inject(config, steps, save_every)
        mttr = f"{r['mttr_s']:.1f}" if r["mttr_s"] is not None else "-"
        line = r["last_line"].removeprefix("hybridflow train: ")[:90]
        print(f"| {name} | {r['rc']} | {r['done']} | {r['complete']} | {r['restarts']} | {r['lost']} | {mttr} | {line} |")  # fmt: skip
        totals[name] = {k: r[k] for k in ("rc", "complete", "restarts", "lost", "mttr_s")}
    return totals
