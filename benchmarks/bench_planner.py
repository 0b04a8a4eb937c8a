"""Auto-mapping planning time for PPO at the paper's model sizes and cluster sizes.

Each case runs the full search from cold caches (every placement, every allocation with sum <= N,
every parallel configuration) once, on one core. Baseline: the paper reports that its search takes
up to half an hour at 70B on 128 GPUs (sec. 8.5; the overview it is summarised in also quotes ~103 s
for that case), so the 70B/128 row is compared against both.

    .venv/bin/python benchmarks/bench_planner.py
"""

from __future__ import annotations

import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from hybridflow.planner import (  # noqa: E402
    ClusterSpec,
    ModelSpec,
    WorkloadSpec,
    build_dataflow,
    clear_caches,
    plan,
    set_partitions,
)

CASES = [("7B", 8), ("13B", 32), ("34B", 64), ("70B", 128)]
PAPER_WORST_S = 30 * 60  # "up to half an hour" at 70B / 128 GPUs
PAPER_MEASURED_70B_S = 103.0  # the overview's figure for 70B / 128 GPUs


def allocations_in_space(n_models: int, n_devices: int) -> int:
    """Device allocations over all placements: per placement of k sets, C(N, k) with n_j >= 1, sum <= N."""
    return sum(math.comb(n_devices, len(p)) for p in set_partitions(range(n_models)))


def main() -> None:
    rows = []
    for size, gpus in CASES:
        clear_caches()
        dataflow = build_dataflow("ppo", ModelSpec.from_param_count(size))
        start = time.perf_counter()
        p = plan(dataflow, ClusterSpec.build("a100-80", gpus), WorkloadSpec())
        seconds = time.perf_counter() - start
        rows.append((size, gpus, seconds, allocations_in_space(4, gpus), p))
    print(
        "| PPO model | GPUs (A100-80) | planning time s | allocations covered | plan | predicted iteration s |"
    )
    print("|---|---|---|---|---|---|")
    for size, gpus, seconds, allocs, p in rows:
        pools = " / ".join(f"{pool.name}:{pool.n_devices}" for pool in p.pools)
        print(
            f"| {size} | {gpus} | {seconds:.2f} | {allocs:,} | {p.strategy} ({pools}) | {p.iteration_seconds:.1f} |"
        )
    worst = rows[-1][2]
    print()
    print("| 70B / 128 GPUs | planning time s | this search is faster by |")
    print("|---|---|---|")
    print(f"| paper, worst case (up to half an hour) | {PAPER_WORST_S:.0f} | {PAPER_WORST_S / worst:,.0f}x |")
    print(
        f"| paper, measured (overview) | {PAPER_MEASURED_70B_S:.0f} | {PAPER_MEASURED_70B_S / worst:,.0f}x |"
    )
    print(f"| hybridflow planner (this run, 1 core) | {worst:.2f} | 1x |")


if __name__ == "__main__":
    main()
