"""The driver's logging cost per step, which lies between one RL step and the next: `Tracker.log` with
each logger set, on a step's metrics (--metrics scalars, ~85 in a GRPO step of the tiny recipes), against
TensorBoard written the common way, `SummaryWriter.add_scalar` once a metric (what the TensorBoard backend
did before it wrote a step's scalars as one event; docs/bench/logging.md).

    .venv/bin/python benchmarks/bench_logging.py [--steps 200] [--metrics 85]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time

from hybridflow.logging import Tracker


def step_metrics(n: int, step: int) -> dict[str, float]:
    groups = ("actor", "critic", "reward", "timing_s", "perf", "rollout", "response_length", "advantages")
    return {f"{groups[i % len(groups)]}/metric_{i}": float(step * 0.001 + i) for i in range(n)}


def median_ms(log, steps: int, n: int) -> float:
    times = []
    for step in range(1, steps + 1):
        metrics = step_metrics(n, step)
        t0 = time.perf_counter()
        log(metrics, step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--metrics", type=int, default=85)
    args = p.parse_args()
    rows = []
    for loggers in (["jsonl"], ["console", "jsonl"], ["tensorboard"], ["console", "jsonl", "tensorboard"]):
        with (
            tempfile.TemporaryDirectory() as d,
            Tracker(d, loggers, total_steps=args.steps, stream=io.StringIO()) as t,
        ):
            rows.append(("+".join(loggers), median_ms(t.log, args.steps, args.metrics)))
    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as d:
        writer = SummaryWriter(log_dir=d)

        def add_scalars(metrics: dict, step: int) -> None:
            for k, v in metrics.items():
                writer.add_scalar(k, v, step)
            writer.flush()

        baseline = median_ms(add_scalars, args.steps, args.metrics)
        writer.close()
    print(f"\n{args.metrics} scalars a step, median of {args.steps - 5} steps\n")
    print("| loggers | Tracker.log ms a step |")
    print("|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")
    tb = dict(rows)["tensorboard"]
    print("\n| TensorBoard, ours (one event a step) ms | SummaryWriter.add_scalar a metric ms | speed-up |")
    print("|---|---|---|")
    print(f"| {tb:.3f} | {baseline:.3f} | {baseline / tb:.2f}x |")


if __name__ == "__main__":
    main()
