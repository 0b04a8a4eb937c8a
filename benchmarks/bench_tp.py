"""Tensor parallel training passes on 2 gloo ranks: the engine's layers computed on their local shards
(engines/tp_regions.py) against the named baseline, torch's ColwiseParallel / RowwiseParallel (DTensor
activations, what the engine ran before).

Workload: GRPO-shaped micro-batches as a run's (microbench_path.grpo_rows: 8 samples per prompt, 5-9-token
prompts, 4-token responses), packed and prompts shared as `hybridflow train` runs them; each step draws
fresh rows with a different number of real tokens, as a run's steps do (a batch repeated step after step
would hide DTensor's per-shape cost). The engine's train_step (forward, backward, clipping, AdamW) and
compute_log_probs on the `--size` tiny Llama, 1 thread a rank; both sides alternate, twice.

    .venv/bin/python benchmarks/bench_tp.py [--size small] [--rows 256] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _child(rank: int, init: str, out: str, side: str, size: str, rows: int, steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import hybridflow.engines.parallelize as par
    from hybridflow.engines.config import EngineConfig, OptimConfig, ParallelConfig
    from hybridflow.engines.train_engine import TrainEngine
    from hybridflow.models.tiny import build_tiny_model
    from hybridflow.planner.microbench_path import _pg_loss, grpo_rows

    if side == "torch styles":  # the baseline: torch's own styles, activations as DTensors
        par.LocalColwise, par.LocalRowwise = ColwiseParallel, RowwiseParallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    cfg = EngineConfig(optim=OptimConfig(lr=1e-5), micro_batch_size_per_device=rows, remove_padding=True,
                       share_prompt=True, parallel=ParallelConfig(tp=2, dp=1))  # fmt: skip
    engine = TrainEngine(build_tiny_model(size, "llama", seed=0), cfg)
    vocab = engine.hf_model.config.vocab_size
    times = {"train_s": [], "infer_s": []}
    for step in range(steps + 1):  # the first is a warm-up
        batch = grpo_rows(vocab, rows, seed=step)  # the same rows on both ranks: one TP group
        for key, fn in (("train_s", lambda b=batch: engine.train_step(b, _pg_loss)),
                        ("infer_s", lambda b=batch: engine.compute_log_probs(b))):  # fmt: skip
            dist.barrier()
            start = time.perf_counter()
            fn()
            if step:
                times[key].append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def run(side: str, size: str, rows: int, steps: int) -> dict[str, float]:
    from hybridflow.planner.microbench_path import as_workers

    with tempfile.TemporaryDirectory() as tmp, as_workers():
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(_child, args=(init, out, side, size, rows, steps), nprocs=2, join=True)
        return {k: statistics.median(v) for k, v in json.load(open(out)).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    sides = ("torch styles", "local regions")
    got = {s: [] for s in sides}
    for _ in range(2):
        for side in sides:
            got[side].append(run(side, args.size, args.rows, args.steps))
    print(f"{args.size} model, tp = 2 on 2 gloo ranks, {args.rows} rows a step (fresh each step), "
          f"median of {args.steps} steps, two runs a side (alternating)\n")  # fmt: skip
    print("| pass | torch styles (baseline) s | local regions s | **speedup** |\n|---|---|---|---|")
    for key, name in (("train_s", "train_step"), ("infer_s", "compute_log_probs")):
        base, ours = (statistics.median(r[key] for r in got[s]) for s in sides)
        runs = (
            " / ".join(f"{r[key]:.3f}" for r in got[sides[0]]),
            " / ".join(f"{r[key]:.3f}" for r in got[sides[1]]),
        )
        print(f"| {name} | {base:.3f} ({runs[0]}) | {ours:.3f} ({runs[1]}) | **{base / ours:.2f}x** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
