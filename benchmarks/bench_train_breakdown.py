"""Where a training step's time goes, piece by piece, as the actor worker runs it (docs/bench/planner.md).

A TrainEngine holds the small tiny Llama with padding removal and shared prompts, as `hybridflow train`
builds the GRPO actor (examples/configs/grpo_tiny.yaml: prompts of 5-9 tokens, 8 samples of 4 tokens
each, one micro-batch of up to 256 rows), and steps the actor's loss on `rows` rows a rank, one thread a
process, in three layouts: d1 (one process), 2xd1 (two single-rank processes at once: the machine shared,
no collective between them) and d2 (two gloo ranks, FSDP2). Each piece of `TrainEngine.train_step` is
timed where it runs: the micro-batch plan, each forward, the loss, the backward (with FSDP2's hooks,
gathers and reduce-scatters at d2), the gradient clipping, AdamW and the LR schedule; FSDP2's unshard +
reshard of every unit is timed on its own, and the step's CPU seconds beside its wall seconds (the
difference is waiting: for a peer at a collective, or for a core). Two row counts separate the fixed
part from the per-token part. Medians over the steps after a warm-up, the max over ranks.

    .venv/bin/python benchmarks/bench_train_breakdown.py [--rows 128 256] [--steps 6] [--optimizer built|loop]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PIECES = ("plan", "forward", "loss", "backward", "clip", "adamw", "schedule", "unshard_reshard")


def _timed(times: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key] += time.perf_counter() - start

    return wrapper


def _engine(dp: int, optimizer: str):
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models.tiny import build_tiny_model

    cfg = EngineConfig(
        parallel=ParallelConfig(dp=dp),
        optim=OptimConfig(lr=1e-3, weight_decay=0.0, grad_clip=1.0),
        micro_batch_size_per_device=256,
        remove_padding=True,
        share_prompt=True,
    )
    engine = TrainEngine(build_tiny_model("small", "llama", seed=0), cfg)
    if optimizer == "loop":  # the per-tensor loop over every parameter, for comparison
        params = [p for p in engine.module.parameters() if p.requires_grad]
        engine.optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, foreach=False)
        from hybridflow.engines.optim import build_scheduler

        engine.scheduler = build_scheduler(engine.optimizer, cfg.optim)
    return engine


def _instrument(engine, times: dict) -> None:
    import warnings

    import hybridflow.engines.train_engine as te

    warnings.filterwarnings(
        "ignore", "Seems like `optimizer.step()` has been overridden"
    )  # the timer wraps it

    engine._plan = _timed(times, "plan", engine._plan)
    engine._forward = _timed(times, "forward", engine._forward)
    engine.optimizer.step = _timed(times, "adamw", engine.optimizer.step)
    engine.scheduler.step = _timed(times, "schedule", engine.scheduler.step)
    te.clip_grad_norm_ = _timed(times, "clip", te.clip_grad_norm_)


def _fsdp_units(engine) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in engine.module.modules() if isinstance(m, FSDPModule)]


def measure(dp: int, rows: int, steps: int, optimizer: str) -> dict[str, float]:
    """Median seconds of each piece per train step on this rank (and the step's total, `step`)."""
    from hybridflow.config.schema import ActorConfig, AlgorithmConfig
    from hybridflow.planner.microbench_path import grpo_rows
    from hybridflow.workers.losses import actor_loss_fn, split_aggregation

    engine = _engine(dp, optimizer)  # dp = 1: plain tensors, no mesh
    times: dict[str, float] = defaultdict(float)
    _instrument(engine, times)
    actor = ActorConfig()
    inner = actor_loss_fn(actor, AlgorithmConfig(), 4, old_from_forward=True)
    loss_fn = _timed(times, "loss", inner)
    batch = grpo_rows(engine.hf_model.config.vocab_size, rows, seed=dist.get_rank() if dp > 1 else 0)
    units = _fsdp_units(engine) if dp > 1 else []
    samples = defaultdict(list)
    for step in range(steps + 1):
        times.clear()
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        engine.train_step(
            batch, loss_fn, with_entropy="detached", loss_weighting=split_aggregation(actor.loss_agg_mode)[1]
        )
        total, cpu = time.perf_counter() - start, time.process_time() - cpu
        dist.barrier()
        gather = time.perf_counter()
        for unit in units:
            unit.unshard()
            unit.reshard()
        times["unshard_reshard"] = time.perf_counter() - gather if units else 0.0
        if step == 0:
            continue  # warm-up
        samples["step"].append(total)
        samples["step_cpu"].append(cpu)  # this process's CPU seconds (its gloo threads too): no waiting
        rest = total - sum(times[k] for k in ("plan", "forward", "loss", "clip", "adamw", "schedule"))
        samples["backward"].append(rest)  # the backward and what forward_backward does around the passes
        for k in PIECES:
            if k != "backward":
                samples[k].append(times[k])
    return {k: statistics.median(v) for k, v in samples.items()}


def _child(rank: int, world: int, tmp: str, rows: list[int], steps: int, optimizer: str) -> None:
    """One rank of the group rank // world (groups of `world` ranks, each its own process group)."""
    torch.set_num_threads(1)
    group, rank = divmod(rank, world)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/init{group}", rank=rank, world_size=world)
    result = {str(r): measure(world, r, steps, optimizer) for r in rows}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(f"{tmp}/out{group}", "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


# layout -> (processes, ranks a group): one process; two single-rank processes at once (the machine
# shared, no collective between them); two ranks of one FSDP2 group
LAYOUTS = {"d1": (1, 1), "2xd1": (2, 1), "d2": (2, 2)}


def run(layout: str, rows: list[int], steps: int, optimizer: str) -> dict:
    """Each piece's median seconds at each row count, the max over every rank of every group."""
    procs, world = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_child, args=(world, tmp, rows, steps, optimizer), nprocs=procs, join=True)
        ranks = []
        for group in range(procs // world):
            with open(f"{tmp}/out{group}") as f:
                ranks += json.load(f)
    return {r: {k: max(g[r][k] for g in ranks) for k in ranks[0][r]} for r in ranks[0]}


def table(results: dict[str, dict], rows: list[int]) -> None:
    """Pieces in ms per step at each (layout, rows), and the fixed part (the intercept of the row counts)."""
    lo, hi = rows[0], rows[-1]
    print("| piece | " + " | ".join(f"{d} {r} rows" for d in results for r in rows) + " | "
          + " | ".join(f"{d} fixed" for d in results) + " |")  # fmt: skip
    print("|---" * (1 + len(results) * (len(rows) + 1)) + "|")
    for piece in ("step", "step_cpu", *PIECES):
        cells = [f"{results[d][str(r)][piece] * 1e3:.1f}" for d in results for r in rows]
        fixed = []
        for d in results:
            a, b = results[d][str(lo)][piece], results[d][str(hi)][piece]
            fixed.append(f"{(a - (b - a) / (hi - lo) * lo) * 1e3:.1f}")
        print(f"| {piece} | " + " | ".join(cells + fixed) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs=2, default=[128, 256], help="rows a rank, two counts")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--optimizer", choices=("built", "loop"), default="built",
                    help="built: the engine's own (build_optimizer); loop: AdamW's per-tensor loop")  # fmt: skip
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; optimizer {args.optimizer}", flush=True)
    results = {d: run(d, args.rows, args.steps, args.optimizer) for d in args.layouts}
    print(json.dumps(results))
    table(results, args.rows)


if __name__ == "__main__":
    main()
