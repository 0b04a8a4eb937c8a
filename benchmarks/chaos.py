"""Chaos: `hybridflow train` runs in which a random worker process is killed (SIGKILL) at a random step.

Each run is the real CLI in a child process with its own embedded Ray cluster: GRPO on the tiny model,
2 worker ranks (data parallel, so a kill may leave the other rank inside a collective), 8 steps,
save_every=2, trainer.max_restarts=3. The run must recover on its own (docs/operations.md): tear the
groups down, start them again, reload the last checkpoint, continue. Reported per run: exit code, steps
completed, restarts, the step after which the kill was sent, the step that failed, the step resumed from, steps lost beyond the last
checkpoint (goal 0), the steps redone, and whether every step's metrics equal those of one uninterrupted
reference run of the same config (timings aside). Baseline: the reference run. With --kinds, one run
per further fault kind (benchmarks/chaos_kinds.py: a hung worker, the raylet and the GCS killed, a
deleted manifest, the reward worker killed, the driver killed at a checkpoint's commit) with its
restarts, steps lost and time to recover.

    .venv/bin/python benchmarks/chaos.py [--runs 3] [--seed 0] [--kinds [--only WORD ...]]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYBRIDFLOW_CPU_THREADS", "1")

import chaos_kinds  # noqa: E402

from tests.trainers.lifecycle_helpers import (  # noqa: E402
    comparable,
    grpo_config,
    kill_a_worker_after,
    metric_rows,
    start_train,
)

STEPS, SAVE_EVERY, RANKS = 8, 2, 2


def write_config(tmp: Path) -> Path:
    from hybridflow.models.tiny import save_tiny_model

    model = save_tiny_model(tmp / "model", size="tiny", arch="llama", seed=0)
    trainer = f"total_steps: {STEPS}, save_every: {SAVE_EVERY}, max_restarts: 3, loggers: [jsonl]"
    return grpo_config(tmp, model, resources=f"n_gpus_per_node: {RANKS}", trainer=trainer)


def one_run(config: Path, name: str, kill_step: int | None, rng: random.Random) -> dict:
    run = config.parent / name
    log = config.parent / f"{name}.log"
    start = time.perf_counter()
    proc = start_train(config, f"trainer.experiment_name={name}", log=log)
    if kill_step is not None:  # the metrics row of step k-1 is written: kill during step k
        kill_a_worker_after(run, kill_step - 1, proc, pick=rng.choice)
    rc = proc.wait(timeout=1800)
    text = log.read_text()
    resumed = [int(x.split()[0]) for x in text.split("resumed from step ")[1:]]
    failed = [int(x) for x in re.findall(r"hybridflow train: restart 1/\d+ at step (\d+)", text)]
    return {
        "failed_step": failed[0] if failed else None,
        "rc": rc,
        "rows": metric_rows(run),
        "restarts": text.count("hybridflow train: restart "),
        "resumed": resumed[0] if resumed else None,
        "kill_step": kill_step,
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", action="store_true", help="also one run per fault kind of chaos_kinds.py")
    parser.add_argument(
        "--only", nargs="*", help="with --kinds: the kinds whose name holds one of these words"
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="hybridflow-chaos-") as tmp:
        config = write_config(Path(tmp))
        ref = one_run(config, "reference", None, rng)
        assert ref["rc"] == 0, f"the reference run failed: see {config.parent / 'reference.log'}"
        expected = [comparable(r) for r in ref["rows"]]
        print(
            f"chaos: {args.runs} runs of {STEPS} GRPO steps (tiny model, {RANKS} ranks, save_every={SAVE_EVERY}),"
        )
        print(
            "one random worker process SIGKILLed during a random step; reference: the same run uninterrupted"
        )
        print()
        print("| run | kill after step | failed in step | exit code | steps done | restarts | resumed from | lost beyond last checkpoint | steps redone | metrics = reference | wall s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print(f"| reference | - | - | {ref['rc']} | {max(r['step'] for r in ref['rows'])} | 0 | - | - | - | - | {ref['wall_s']:.0f} |")  # fmt: skip
        totals = {"completed": 0, "restarts": 0, "lost": 0, "equal": 0}
        for i in range(args.runs):
            k = rng.randint(1, STEPS)
            r = one_run(config, f"run{i}", k, rng)
            steps = sorted({row["step"] for row in r["rows"]})
            done = steps[-1] if steps else 0
            failed = r["failed_step"] or k  # the kill lands in step k, or later on a loaded machine
            last_ckpt = (failed - 1) // SAVE_EVERY * SAVE_EVERY  # the newest checkpoint before the failure
            lost = last_ckpt - r["resumed"] if r["resumed"] is not None else "-"
            redone = (failed - 1) - r["resumed"] if r["resumed"] is not None else "-"
            equal = [comparable(row) for row in r["rows"]] == expected
            ok = r["rc"] == 0 and done == STEPS and steps == list(range(STEPS + 1))
            totals["completed"] += ok
            totals["restarts"] += r["restarts"]
            totals["lost"] += lost if isinstance(lost, int) else 0
            totals["equal"] += equal
            print(f"| {i} | {k - 1} | {failed} | {r['rc']} | {done} | {r['restarts']} | {r['resumed']} | {lost} | {redone} | {equal} | {r['wall_s']:.0f} |")  # fmt: skip
        print()
        print(
            f"completed {totals['completed']}/{args.runs}, restarts {totals['restarts']}, steps lost beyond the "
            f"last checkpoint {totals['lost']}, metrics equal to the reference {totals['equal']}/{args.runs}"
        )
        kinds = chaos_kinds.report(config, STEPS, SAVE_EVERY, args.only) if args.kinds else {}
        print(json.dumps({"chaos": totals, "runs": args.runs, "kinds": kinds}))


if __name__ == "__main__":
    main()
