"""Benchmark the single controller's overheads: dispatch of an empty call, and moving batches.

1. Dispatch: median wall time of an empty ONE_TO_ALL call on groups of 1, 2, 4, 8 workers, next to a
   raw Ray baseline (one empty actor call per worker, then ray.get of all).
2. Throughput (GB/s) of a float32 batch of 1 MB / 64 MB / 512 MB:
   - driver -> group: a DP_PROTO call on 2 workers (split, put once per shard, each rank fetches its
     shard); baseline: ray.put of the same bytes + one raw actor that ray.gets them (and copies them
     into writable memory, as any consumer that computes on them must; Batch does the same).
   - group -> group: a Future from a 2-rank producer group consumed by a 2-rank group on another pool
     (each consumer rank fetches its shard from the producers' outputs); baseline: a raw actor returns
     the array, another raw actor ray.gets (and copies) it. Producer compute is excluded in both.
   Ratios are ours / baseline (1.0 = as fast as raw Ray; < 1 slower).
3. The advantages' call of a synchronous RL step (`Worker.apply` on rank 0, trainers/experience.py),
   median ms from issuing it to its end, at three rollout sizes (rows x prompt + response tokens):
   fed the driver's whole copy of the rollout (sent out again: what every step paid before) against
   the generation's own Future plus a Batch of the fields the driver added, the rule scores and the old
   log-probs (`Pending.rollout_parts`, what it is fed now). Baseline: the whole copy.

    .venv/bin/python benchmarks/bench_controller.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import ray
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from hybridflow.batch import Batch  # noqa: E402
from hybridflow.controller import Protocol, ResourcePool, Worker, WorkerGroup, register  # noqa: E402

MB = 1 << 20


class BenchWorker(Worker):
    @register(Protocol.ONE_TO_ALL)
    def noop(self):
        return None

    @register(Protocol.DP_PROTO)
    def receive(self, batch: Batch) -> int:
        return int(batch["data"].shape[0])

    @register(Protocol.DP_PROTO, blocking=False)
    def make(self, spec: Batch, cols: int) -> Batch:
        return Batch({"data": torch.ones(len(spec), cols)})

    @register(Protocol.DP_PROTO, blocking=False)
    def rollout(self, spec: Batch, lp: int, lr: int) -> Batch:
        """A generation's output of len(spec) rows: a prompt of lp tokens and a response of lr each."""
        b, ids = len(spec), torch.randint(0, 150_000, (len(spec), lp + lr))
        return Batch({
            "prompts": ids[:, :lp].clone(), "responses": ids[:, lp:].clone(), "input_ids": ids,
            "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(lp + lr).repeat(b, 1),
            "response_mask": torch.ones(b, lr, dtype=torch.long), "rollout_log_probs": torch.randn(b, lr),
        })  # fmt: skip


def _rows(*parts: Batch) -> int:
    from hybridflow.trainers.experience import join

    return len(join(*parts))


@ray.remote(num_cpus=0)
class RawActor:
    def noop(self):
        return None

    def make(self, rows: int, cols: int):
        return np.ones((rows, cols), dtype=np.float32)

    def fetch(self, refs) -> int:
        # ray.get of a numpy array is a zero-copy view of read-only shared memory; a consumer that
        # computes on (writes) the data needs its own copy, which Batch makes when it is unpickled.
        return int(np.array(ray.get(refs[0]), copy=True).shape[0])


def _paired_ms(ours, raw, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """Median ms of `ours` and `raw`, timed alternately so both see the same (noisy, shared) machine.

    A function may return its own duration in seconds (to exclude set-up such as producer compute).
    """
    for _ in range(warmup):
        ours(), raw()
    times: tuple[list, list] = ([], [])
    for _ in range(repeats):
        for fn, out in ((ours, times[0]), (raw, times[1])):
            t0 = time.perf_counter()
            took = fn()
            out.append(took if isinstance(took, float) else time.perf_counter() - t0)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def bench_dispatch(sizes: list[int], repeats: int) -> list[tuple]:
    rows = []
    for n in sizes:
        pool = ResourcePool(n, name=f"dispatch{n}")
        group = WorkerGroup(BenchWorker, pool)
        raws = [RawActor.remote() for _ in range(n)]
        ray.get([a.noop.remote() for a in raws])
        ours, raw = _paired_ms(
            group.noop, lambda raws=raws: ray.get([a.noop.remote() for a in raws]), repeats
        )
        rows.append((n, ours, raw))
        group.shutdown()
        pool.shutdown()
        for a in raws:
            ray.kill(a)
    return rows


def bench_transfer(sizes_mb: list[int], repeats: dict[int, int]) -> list[tuple]:
    cols = 256 * 1024 // 4  # 256 KiB rows: 1 MB = 4 rows, 512 MB = 2048 rows
    pool_a, pool_b = ResourcePool(2, name="producer"), ResourcePool(2, name="consumer")
    prod, cons = WorkerGroup(BenchWorker, pool_a), WorkerGroup(BenchWorker, pool_b)
    raw_a, raw_b = RawActor.remote(), RawActor.remote()
    rows = []
    for mb in sizes_mb:
        n_rows, reps = mb * MB // (cols * 4), repeats[mb]
        nbytes = n_rows * cols * 4
        batch = Batch({"data": torch.ones(n_rows, cols)})
        arr = batch["data"].numpy()
        d2g, d2g_raw = _paired_ms(
            lambda batch=batch: cons.receive(batch),
            lambda arr=arr: ray.get(raw_b.fetch.remote([ray.put(arr)])),
            reps,
            warmup=1,
        )

        def group_to_group(n_rows=n_rows) -> float:
            fut = prod.make(Batch({"i": torch.arange(n_rows)}), cols)
            fut.wait()  # producer compute excluded
            t0 = time.perf_counter()
            cons.receive(fut)
            return time.perf_counter() - t0

        def raw_to_raw(n_rows=n_rows) -> float:
            ref = raw_a.make.remote(n_rows, cols)
            ray.wait([ref])
            t0 = time.perf_counter()
            ray.get(raw_b.fetch.remote([ref]))
            return time.perf_counter() - t0

        g2g, g2g_raw = _paired_ms(group_to_group, raw_to_raw, reps, warmup=1)
        rows.append((mb, nbytes, d2g, d2g_raw, g2g, g2g_raw))
        del batch, arr
    for g in (prod, cons):
        g.shutdown()
    for p in (pool_a, pool_b):
        p.shutdown()
    return rows


def bench_experience_call(shapes: list[tuple[int, int, int]], repeats: int) -> list[tuple]:
    """(rows, prompt, response, MB of the rollout, whole copy ms, Future + driver's fields ms) per shape."""
    pool = ResourcePool(1, name="experience")
    group = WorkerGroup(BenchWorker, pool)

    def fed(*parts):
        t0 = time.perf_counter()
        group.apply(_rows, *parts)
        return time.perf_counter() - t0

    out = []
    for rows, lp, lr in shapes:
        generated = group.rollout(Batch({"i": torch.arange(rows)}), lp, lr)
        local = generated.get()  # the driver's copy, as a synchronous source fetches it for the reward
        local["scores"], local["old_log_probs"] = torch.randn(rows), local["rollout_log_probs"]
        added = local.select(["old_log_probs", "scores"])
        now, before = _paired_ms(
            lambda g=generated, a=added: fed(g, a), lambda whole=local: fed(whole), repeats, warmup=1
        )
        out.append((rows, lp, lr, local.nbytes() / 1e6, before, now))
    group.shutdown()
    pool.shutdown()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no 512 MB")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    repeats = 20 if args.quick else 50
    sizes_mb = [1, 64] if args.quick else [1, 64, 512]
    dispatch = bench_dispatch([1, 2, 4, 8], repeats)
    transfer = bench_transfer(sizes_mb, {1: 20, 64: 5, 512: 3})
    shapes = [(512, 8, 4), (256, 512, 1024)] + ([] if args.quick else [(1024, 1024, 4096)])
    experience = bench_experience_call(shapes, 5 if args.quick else 9)
    ray.shutdown()

    print(f"\nMachine: {os.cpu_count()} cores, CPU only; torch {torch.__version__}, ray {ray.__version__}\n")
    print("| workers | empty call, ours (median ms) | raw Ray calls (median ms) | ours / raw |")
    print("|---|---|---|---|")
    for n, ours, raw in dispatch:
        print(f"| {n} | {ours:.2f} | {raw:.2f} | {ours / raw:.2f}x |")
    print(
        "\n| batch | driver->group GB/s | raw put/get GB/s | ratio | group->group GB/s | raw actor->actor GB/s | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for mb, nbytes, d2g, d2g_raw, g2g, g2g_raw in transfer:
        gbs = [nbytes / (t / 1e3) / 1e9 for t in (d2g, d2g_raw, g2g, g2g_raw)]
        print(
            f"| {mb} MB | {gbs[0]:.2f} | {gbs[1]:.2f} | {gbs[0] / gbs[1]:.2f} "
            f"| {gbs[2]:.2f} | {gbs[3]:.2f} | {gbs[2] / gbs[3]:.2f} |"
        )
    print("\n| rollout (rows x prompt + response) | MB | advantages' call fed the driver's whole copy (ms) "
          "| fed the generation's Future + the driver's fields (ms) | speed-up |")  # fmt: skip
    print("|---|---|---|---|---|")
    for rows, lp, lr, mb, before, now in experience:
        print(f"| {rows} x {lp} + {lr} | {mb:.0f} | {before:.1f} | {now:.1f} | {before / now:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
