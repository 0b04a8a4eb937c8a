"""Which hybridflow/ files one GRPO step runs code in: the measurement behind docs/design.md §9.

    .venv/bin/python scripts/step_files.py            # one file a line, relative to hybridflow/, then the count

Runs `hybridflow train examples/configs/grpo_tiny.yaml` for four steps on a freshly built tiny model (8
prompts x 8 samples, no validation, no checkpoint) with a profile hook in every process: a sitecustomize
module on PYTHONPATH, which the Ray workers inherit from the driver. The hook records each hybridflow/ file
in which a Python function is called while a flag file exists; the flag is set when step 1's metrics row
is written and cleared when step 3's is, so the window holds at least one whole step in the steady state
even when this poll sees step 1's row late on a loaded machine (start-up, step 1's first-call imports and
the shutdown fall outside it). tests/trainers/test_step_files.py runs
this and checks that §9 names every file it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "hybridflow") + os.sep

# The hook reads the flag at most every 20 ms (a stat per call would slow the step it measures).
HOOK = """
import os, sys, threading, time
FLAG, OUT, PACKAGE = {flag!r}, {out!r}, {package!r}
seen, state = set(), {{"t": 0.0, "on": False}}

def _hook(frame, event, arg):
    if event != "call":
        return
    now = time.monotonic()
    if now - state["t"] > 0.02:
        state["t"], state["on"] = now, os.path.exists(FLAG)
    name = frame.f_code.co_filename
    if state["on"] and name.startswith(PACKAGE) and name not in seen:
        seen.add(name)
        with open(os.path.join(OUT, f"{{os.getpid()}}.txt"), "a") as fh:
            fh.write(name + "\\n")

sys.setprofile(_hook)
threading.setprofile(_hook)
"""


def _steps_logged(run_dir: Path) -> set[int]:
    steps = set()
    for path in run_dir.rglob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                steps.add(json.loads(line).get("step"))
            except (json.JSONDecodeError, AttributeError):
                continue  # a row still being written
    return steps


def _train(work: Path, model: Path, flag: Path, timeout: float) -> None:
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", str(ROOT / "examples/configs/grpo_tiny.yaml")]
    cmd += [f"model.path={model}", f"trainer.output_dir={run_dir}", "trainer.loggers=[jsonl]"]
    cmd += ["trainer.total_steps=4", "trainer.val_every=0", "trainer.val_before_train=false"]
    cmd += ["trainer.save_every=0", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    path = os.pathsep.join(p for p in (str(work / "site"), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    log = open(work / "train.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline, window = time.monotonic() + timeout, "before"
    while proc.poll() is None and time.monotonic() < deadline:
        steps = _steps_logged(run_dir)
        if window == "before" and 1 in steps:
            flag.touch()
            window = "open"
        elif window == "open" and 3 in steps:
            flag.unlink()
            window = "closed"
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.returncode != 0 or window != "closed":
        tail = (work / "train.log").read_text()[-3000:]
        raise RuntimeError(f"training exited {proc.returncode} with the window {window}:\n{tail}")


def measure(timeout: float = 600.0) -> list[str]:
    """The hybridflow/ files (relative, sorted) that ran code during one GRPO step of the demo recipe."""
    from hybridflow.models.tiny import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="step_files_") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "calls").mkdir()
        flag = work / "on"
        hook = HOOK.format(flag=str(flag), out=str(work / "calls"), package=PACKAGE)
        (work / "site" / "sitecustomize.py").write_text(hook)
        model = save_tiny_model(work / "model", size="tiny", arch="llama", seed=0)
        _train(work, model, flag, timeout)
        files = set()
        for path in (work / "calls").glob("*.txt"):
            files |= set(path.read_text().split())
    return sorted(f[len(PACKAGE) :] for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the training run may take")
    files = measure(parser.parse_args().timeout)
    print("\n".join(files))
    print(f"{len(files)} files")


if __name__ == "__main__":
    main()
