"""Fault kinds of benchmarks/chaos.py beyond a killed worker: a hung worker (SIGSTOP, caught by
trainer.hang_timeout_s), the raylet and the GCS each killed mid-run (recovered by `hybridflow train`'s
supervisor with a new embedded cluster), the GCS killed after the last checkpoint, the newest
checkpoint's manifest deleted before a resume, the reward worker killed while idle (replaced by the
reward pool) and the driver killed at a checkpoint's commit instant (its row already written). One real `hybridflow train` run per kind (the
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


def _reward_worker(proc) -> int:
    """The reward worker process: not the processes it forks to run samples (they share its command line)."""
    found = [p for p in descendants(proc.pid) if "hybridflow.rewards._worker" in cmdline(p)]
    return next(p for p in found if _parent(p) not in found)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def reward_worker_killed(config: Path, steps: int, save_every: int) -> dict:
    """The reward worker (a user reward runs in one) SIGKILLed while idle between steps: replaced by the
    reward pool itself at its next batch, no restart. MTTR: the scoring phase that replaced it (its
    `timing_s/reward`); the last column: the step whose row counts the replacement."""
    run, log = config.parent / "reward_worker", config.parent / "reward_worker.log"
    proc = start_train(config, "trainer.experiment_name=reward_worker", log=log)
    _after_row(run, FAULT_AFTER, proc)
    os.kill(_reward_worker(proc), signal.SIGKILL)
    r = _finish(proc, log, run, steps, save_every, None, None)
    replaced = [row for row in metric_rows(run) if row.get("reward/worker_restarts")]
    r["mttr_s"] = replaced[0].get("timing_s/reward") if replaced else None
    r["last_line"] = ", ".join(
        f"step {x['step']}: reward/worker_restarts {x['reward/worker_restarts']:g}" for x in replaced
    )
    return r


def driver_at_commit(config: Path, steps: int, save_every: int) -> dict:
    """The training driver SIGKILLed the instant `latest` names a new checkpoint (after the commit,
    before anything else): the supervisor names the driver and a new one resumes from that checkpoint."""
    run, log = config.parent / "driver", config.parent / "driver.log"
    proc = start_train(config, "trainer.experiment_name=driver", log=log)
    step = (FAULT_AFTER + 1) // save_every * save_every  # the first checkpoint after FAULT_AFTER
    latest = run / "checkpoints" / "latest"
    wait_for(lambda: latest.exists() and latest.read_text().strip() == f"step_{step}", proc, poll=0.002)
    os.kill(
        next(p for p in descendants(proc.pid) if "-m hybridflow.trainers.cli " in cmdline(p)), signal.SIGKILL
    )
    mttr = _time_to_line(log, r"resumed from step \d+ \(restart", proc, time.monotonic())
    r = _finish(proc, log, run, steps, save_every, mttr, step)
    r["last_line"] = next((x for x in log.read_text().splitlines() if " restart 1/" in x), r["last_line"])
    return r


KINDS = {
    "hung worker (SIGSTOP, hang_timeout_s=10)": hung_worker,
    "raylet killed mid-run": node_process_kill("raylet"),
    "GCS killed mid-run": node_process_kill("gcs_server"),
    "GCS killed after the last checkpoint": gcs_after_last_checkpoint,
    "newest manifest deleted, then resume=auto": manifest_deleted,
    "reward worker SIGKILLed while idle": reward_worker_killed,
    "driver SIGKILLed at a checkpoint's commit": driver_at_commit,
}


def report(config: Path, steps: int, save_every: int, only: list[str] | None = None) -> dict:
    """One run per fault kind (`only`: the kinds whose name holds one of these words)."""
    print()
    print(f"| fault (after step {FAULT_AFTER}) | exit code | steps done | completed | restarts | lost beyond last checkpoint | MTTR s | last line |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    totals = {}
    for name, inject in KINDS.items():
        if only and not any(word in name for word in only):
            continue
        r = inject(config, steps, save_every)
        mttr = f"{r['mttr_s']:.1f}" if r["mttr_s"] is not None else "-"
        line = r["last_line"].removeprefix("hybridflow train: ")[:90]
        print(f"| {name} | {r['rc']} | {r['done']} | {r['complete']} | {r['restarts']} | {r['lost']} | {mttr} | {line} |")  # fmt: skip
        totals[name] = {k: r[k] for k in ("rc", "complete", "restarts", "lost", "mttr_s")}
    return totals
