"""Pipeline bubble of each schedule engines/pipeline.py runs, against the textbook (p - 1) / (m + p - 1).

The schedules are torch.distributed.pipelining's own: each is built for p ranks (a fake process group,
no processes) and its per-rank action order (`pipeline_order`) is replayed with the dependencies a
pipeline has (a stage's forward of micro-batch i after the previous stage's; its backward after the next
stage's backward, the last stage's after its own forward), forward 1 time unit and backward 2 (a backward
is about two forwards of matmuls). The bubble is the share of a rank's time it waits: 1 - busy / makespan,
averaged over ranks. Interleaved 1F1B runs v = 2 stages a rank; its textbook bubble is
(p - 1) / (v m + p - 1). These are the schedules' idle slots under those unit costs, not timings.
"in flight": the most micro-batches whose activations a rank holds at once (a stage's micro-batch under
interleaving), the schedule's share of peak activation memory.

    .venv/bin/python benchmarks/bench_pipeline.py
    .venv/bin/python benchmarks/bench_pipeline.py --measured   # 2 ranks, a ~100M Llama (pipeline_measured.py)
    .venv/bin/python benchmarks/bench_pipeline.py --bubble     # 2 ranks: each schedule's wall-clock bubble
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

from hybridflow.engines.pipeline import build_schedule  # noqa: E402

COST = {"FORWARD": 1.0, "FULL_BACKWARD": 2.0}  # other actions (the gradient reduction) take no time
CASES = [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32)]
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}  # stages per rank


def schedule_order(name: str, p: int, m: int, v: int) -> dict[int, list[tuple]]:
    """rank -> [(kind, stage, micro-batch)] that schedule `name` runs over p ranks, v stages each."""
    if name == "1f1b":
        return {r: one_f_one_b(r, p, m) for r in range(p)}
    from torch.distributed.pipelining import PipelineStage

    x = torch.empty(1, 2, device="meta", requires_grad=True)
    stages = [
        PipelineStage(torch.nn.Linear(2, 2), k * p, p * v, torch.device("cpu"), (x,), (x,)) for k in range(v)
    ]
    table = build_schedule(name, stages, m).pipeline_order
    return {
        r: [(a.computation_type.name, a.stage_index, a.microbatch_index) for a in actions if a is not None]
        for r, actions in table.items()
    }


def one_f_one_b(stage: int, p: int, m: int) -> list[tuple]:
    """The order Schedule1F1B._step_microbatches runs on `stage`: min(m, p - stage) forwards, then a
    backward and a forward in turn, then the remaining backwards. (Its `pipeline_order` table, the IR
    other schedules are replayed from, starts the last stage at micro-batch 1 in torch 2.13.)"""
    warmup = min(m, p - stage)
    order = [("FORWARD", stage, i) for i in range(warmup)]
    for i in range(m):
        order.append(("FULL_BACKWARD", stage, i))
        if warmup + i < m:
            order.append(("FORWARD", stage, warmup + i))
    return order


def replay(order: dict[int, list[tuple]], num_stages: int) -> float:
    """Bubble fraction of the order: each rank runs its actions in turn, each as soon as its
    dependencies (module docstring) are done."""
    done: dict[tuple, float] = {}
    pos, free = dict.fromkeys(order, 0), dict.fromkeys(order, 0.0)
    while any(pos[r] < len(order[r]) for r in order):
        moved = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                kind, s, i = acts[pos[r]]
                if kind not in COST:
                    pos[r] += 1
                    continue
                dep = ("FORWARD", s - 1, i) if kind == "FORWARD" and s > 0 else None
                if kind == "FULL_BACKWARD":
                    dep = ("FULL_BACKWARD", s + 1, i) if s < num_stages - 1 else ("FORWARD", s, i)
                if dep is not None and dep not in done:
                    break
                start = max(free[r], done.get(dep, 0.0))
                free[r] = done[(kind, s, i)] = start + COST[kind]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule's order deadlocks under the pipeline's dependencies")
    makespan = max(free.values())
    busy = [sum(COST.get(a[0], 0.0) for a in acts) for acts in order.values()]
    return sum(1 - b / makespan for b in busy) / len(busy)


def in_flight(order: dict[int, list[tuple]]) -> int:
    """Most micro-batch forwards any rank holds activations of (forwards run, backwards not yet)."""
    peak = 0
    for acts in order.values():
        held = 0
        for kind, _, _ in acts:
            held += {"FORWARD": 1, "FULL_BACKWARD": -1}.get(kind, 0)
            peak = max(peak, held)
    return peak


def main() -> None:
    print(f"{'schedule':<18}{'p':>3}{'m':>4}  {'bubble':>7}  {'textbook':>8}  ratio  in flight")
    for name, v in SCHEDULES.items():
        for p, m in CASES:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
            try:
                order = schedule_order(name, p, m, v)
                bubble, held = replay(order, p * v), in_flight(order)
            finally:
                dist.destroy_process_group()
            textbook = (p - 1) / (v * m + p - 1)
            print(
                f"{name:<18}{p:>3}{m:>4}  {bubble:>7.3f}  {textbook:>8.3f}  {bubble / textbook:.2f}x  {held:>9}"
            )


if __name__ == "__main__":
    import sys

    if "--measured" in sys.argv or "--bubble" in sys.argv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from pipeline_measured import bubble_main
        from pipeline_measured import main as measured

        bubble_main() if "--bubble" in sys.argv else measured()
    else:
        main()
