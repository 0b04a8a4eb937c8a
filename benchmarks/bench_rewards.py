"""Rule-reward timeouts: what a batch of hanging samples costs, beside per-sample timeouts run one after
another (the baseline: each hanging sample holds its worker for timeout_s, so a batch costs
hanging x timeout_s / workers; the executor worked that way before timeouts went concurrent), with
the executor's own count of the timeout_s periods waited one after another (reward/timeout_waits).

Also the cost of the ordinary path (no hang), so the safety does not tax cheap rewards: samples/s of an
exact-match user reward through the worker processes.

    .venv/bin/python benchmarks/bench_rewards.py [--timeout 2]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import textwrap
import time
from pathlib import Path

from hybridflow.rewards import RewardConfig, RewardExecutor

REWARD = textwrap.dedent(
    """
    import time
    def score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(3600)
        return float(solution_str == ground_truth)
    """
)


def run_case(spec: str, workers: int, timeout: float, n: int, hanging: int) -> tuple[float, int, int]:
    cfg = RewardConfig(fn=spec, num_workers=workers, timeout_s=timeout, max_error_fraction=1.0)
    responses = ["hang" if i % (n // hanging) == 0 else "a" for i in range(n)] if hanging else ["a"] * n
    with RewardExecutor(cfg) as ex:
        start = time.monotonic()
        result = ex.score("bench", responses, ["a"] * n)
        elapsed = time.monotonic() - start
    return elapsed, int(result.metrics["reward/num_timeouts"]), int(result.metrics["reward/timeout_waits"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=2.0, help="reward.timeout_s")
    args = parser.parse_args()
    logging.getLogger("hybridflow.rewards").setLevel(logging.ERROR)  # every timeout is expected here
    t = args.timeout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench_reward.py"
        path.write_text(REWARD)
        spec = f"{path}:score"
        print(f"hanging samples, reward.timeout_s={t:g}")
        print("| batch | hanging | workers | timeouts reported | timeouts waited | wall s | wall / timeout_s | "
              "one-after-another s | ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for n, hanging, workers in [(16, 16, 1), (64, 64, 1), (64, 64, 2), (64, 16, 1), (256, 256, 2)]:
            wall, timeouts, waits = run_case(spec, workers, t, n, hanging)
            sequential = hanging * t / workers
            print(f"| {n} | {hanging} | {workers} | {timeouts} | {waits} | {wall:.1f} | {wall / t:.2f} | "
                  f"{sequential:.0f} | {sequential / wall:.1f}x faster |")  # fmt: skip
        print("\nno hang (exact match, user reward file in worker processes)")
        print("| samples | workers | wall s | samples/s |")
        print("|---|---|---|---|")
        for workers in (1, 2):
            n = 4096
            wall, _, _ = run_case(spec, workers, t, n, 0)
            print(f"| {n} | {workers} | {wall:.2f} | {n / wall:,.0f} |")


if __name__ == "__main__":
    main()
