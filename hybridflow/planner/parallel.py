"""`auto_parallel`: the best parallel configurations of one model on n devices (paper Alg. 1, line 6).

For a model and a device count it enumerates every 3D configuration (p, t, d) with p*t*d = n (t a
power of two inside a node dividing the heads, p dividing the layers, both inside the executing
engines' `EngineLimits`; the default limits are none, the paper's search), activation checkpointing on or
off, the model's state resident or offloaded to host memory between its stages, and for the actor
every generation layout (pg, tg) with pg | p and tg | t (3D-HybridEngine). Each option is simulated;
generation layouts whose KV cache does not fit are dropped, so the KV-cache check raises tg (or pg)
exactly when needed.

Colocated models compete for memory, so rather than one winner this returns the Pareto front of
(latency, persistent bytes, transient bytes): the set-level search (search.py) picks one option per
model so that the pool fits. Results are cached per (model, device count, limits): each placement
and allocation that gives a model n devices reuses them, which is the paper's caching.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from hybridflow.planner import memory as mem
from hybridflow.planner import simulate as sim
from hybridflow.planner.dataflow import STAGES, ModelTask
from hybridflow.planner.specs import ClusterSpec, EngineLimits, ModelSpec, WorkloadSpec

UNCONSTRAINED = EngineLimits()


@dataclass(frozen=True)
class ModelOption:
    """One model's parallel configuration on n devices, with its simulated cost."""

    role: str
    n_devices: int
    p: int  # pipeline-parallel size (training and inference)
    t: int  # tensor-parallel size
    d: int  # data-parallel size
    pg: int  # generation pipeline size (actor only; else = p)
    tg: int  # generation tensor size (actor only; else = t)
    checkpoint: bool  # activation checkpointing in training
    offload: bool  # state parked in host memory while the model is idle
    waves: int  # generation rounds per replica (> 1 when the KV cache cannot hold all sequences)
    stage_times: tuple[float, float, float]  # seconds in (generation, preparation, training)
    switch_time: float  # actor train -> generate resharding, included in stage_times[0]
    persistent_bytes: float  # per device, held across the iteration
    transient_bytes: float  # per device, extra peak while this model runs

    @property
    def total_time(self) -> float:
        return sum(self.stage_times)

    @property
    def dg(self) -> int:
        """Micro-DP size: generation replicas per training replica."""
        return (self.p * self.t) // (self.pg * self.tg)


def _powers_of_two_upto(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def model_parallel_sizes(
    spec: ModelSpec,
    n: int,
    devices_per_node: int,
    limits: EngineLimits = UNCONSTRAINED,
    role: str | None = None,
) -> list[tuple[int, int, int]]:
    """All (p, t, d) with p*t*d = n that the model's shape and the engines' limits for `role` allow."""
    out = []
    for t in _powers_of_two_upto(min(n, devices_per_node)):
        if not limits.allows_tp(spec, t):
            continue
        for p in range(1, min(spec.num_layers, n // t) + 1):
            if spec.num_layers % p == 0 and n % (p * t) == 0 and limits.allows(role, p, t):
                out.append((p, t, n // (p * t)))
    return out


@functools.cache
def _train_time(spec, dev, wl, dpn, p, t, d, ckpt):
    return sim.training_time(spec, dev, wl, dpn, p, t, d, ckpt)


@functools.cache
def _infer_time(spec, dev, wl, dpn, p, t, d):
    return sim.inference_time(spec, dev, wl, dpn, p, t, d)


def _pareto(options: list[ModelOption]) -> list[ModelOption]:
    """Drop options beaten on latency, persistent and transient bytes by another; fastest first.

    Options are visited fastest first, so an option survives unless an earlier (faster) one also
    needs no more of either kind of memory: a 2-D staircase query, kept as lists sorted by
    persistent bytes with strictly falling transient bytes.
    """
    kept: list[ModelOption] = []
    stair_p: list[float] = []
    stair_t: list[float] = []
    for o in sorted(options, key=_option_key):
        i = bisect.bisect_right(stair_p, o.persistent_bytes) - 1
        if i >= 0 and stair_t[i] <= o.transient_bytes:
            continue  # a faster option needs no more memory of either kind
        kept.append(o)
        # insert, dropping staircase steps the new point dominates
        j = bisect.bisect_left(stair_p, o.persistent_bytes)
        k = j
        while k < len(stair_p) and stair_t[k] >= o.transient_bytes:
            k += 1
        stair_p[j:k] = [o.persistent_bytes]
        stair_t[j:k] = [o.transient_bytes]
    return kept


def _option_key(o: ModelOption):
    # total time first; ties broken towards less memory and smaller model parallelism (determinism)
    return (
        o.total_time,
        o.persistent_bytes + o.transient_bytes,
        o.p,
        o.t,
        o.pg,
        o.tg,
        o.offload,
        o.checkpoint,
    )


@functools.cache
def _generation_layouts(task, dev, wl, dpn, n, p, t, d, max_pg):
    """(gen time incl. switch, KV + gathered-weight bytes, pg, tg, switch, waves) per useful layout,
    with pg <= max_pg (None: any divisor of p).

    Each (pg, tg) is tried with 1, 2, 4, ... waves of sequences per replica: fewer waves are faster but
    need a bigger KV cache; which one a pool can afford depends on its other models, so all layouts
    not beaten on both time and bytes are kept (fastest first).
    """
    spec, bpp = task.spec, dev.bytes_per_param
    found = []
    for tg in (x for x in _powers_of_two_upto(t) if t % x == 0):
        for pg in (x for x in range(1, min(p, max_pg or p) + 1) if p % x == 0):
            replicas = n // (pg * tg)
            per_replica = -(-int(wl.sequences * task.generation_factor) // replicas)
            extra = mem.generation_extra_weight_bytes(spec, bpp, p, t, pg, tg)
            switch = sim.switch_time(spec, dev, dpn, p, t, d, pg, tg)
            waves = 1
            while True:
                concurrent = -(-per_replica // waves)
                kv = mem.kv_cache_bytes(spec, bpp, concurrent, wl.seq_len, pg, tg)
                gen = sim.generation_time(spec, dev, wl, dpn, n, pg, tg, task.generation_factor, waves)
                found.append((gen + switch, kv + extra, pg, tg, switch, waves))
                if concurrent == 1:
                    break
                waves *= 2
    found.sort()
    out, least = [], float("inf")
    for f in found:
        if f[1] < least:
            out.append(f)
            least = f[1]
    return tuple(out)


def enumerate_options(
    task: ModelTask, cluster: ClusterSpec, wl: WorkloadSpec, n: int, limits: EngineLimits = UNCONSTRAINED
) -> list[ModelOption]:
    """Every feasible option of `task` alone on n devices (it may still not fit next to others) that
    the engines' `limits` allow.

    An offloaded model brings its whole state in for each stage it works in (2 host transfers per
    stage) and holds nothing between stages.
    """
    dev, dpn = cluster.device, cluster.devices_per_node
    spec, bpp = task.spec, dev.bytes_per_param
    wl = wl.for_role(task.role)
    budget = dev.memory_bytes * dev.usable_memory_fraction
    kinds = task.kinds()
    lm_head = task.role in ("actor", "reference")
    worked = {stage for stage, _ in task.work}
    options = []
    for p, t, d in model_parallel_sizes(spec, n, dpn, limits, task.role):
        state = (
            mem.train_state_bytes(spec, bpp, p, t, d) if task.trains else mem.weight_bytes(spec, bpp, p, t)
        )
        infer, infer_act = 0.0, 0.0
        if "infer" in kinds:
            infer = _infer_time(spec, dev, wl, dpn, p, t, d)
            mbs = wl.inference_micro_batch_size
            infer_act = mem.inference_activation_bytes(spec, bpp, wl.seq_len, mbs, t, lm_head)
        gens = ((0.0, 0.0, p, t, 0.0, 1),)
        if task.generates:
            gens = _generation_layouts(task, dev, wl, dpn, n, p, t, d, limits.max_pg)
        for offload in (False, True):
            held, parked = (0.0, state) if offload else (state, 0.0)
            move = 2 * state / dev.host_bandwidth if offload else 0.0
            for ckpt in (False, True) if task.trains else (False,):
                train, train_act = 0.0, 0.0
                if task.trains:
                    train = _train_time(spec, dev, wl, dpn, p, t, d, ckpt)
                    m = -(-wl.sequences // (wl.mini_batches * d * wl.micro_batch_size))
                    mbs = wl.micro_batch_size
                    train_act = mem.train_activation_bytes(spec, bpp, wl.seq_len, mbs, p, t, m, ckpt, lm_head)
                peak = parked + max(train_act, infer_act)
                if held + peak > budget:
                    continue
                for gen, gen_bytes, pg, tg, switch, waves in gens:
                    transient = max(peak, parked + gen_bytes)
                    if held + transient > budget:
                        continue  # the KV cache does not fit: a larger tg/pg or more waves must
                    times = {"generation": gen, "preparation": infer, "training": train}
                    stage_times = tuple(times[s] + (move if s in worked else 0.0) for s in STAGES)
                    options.append(
                        ModelOption(
                            task.role,
                            n,
                            p,
                            t,
                            d,
                            pg,
                            tg,
                            ckpt,
                            offload,
                            waves,
                            stage_times,
                            switch,
                            held,
                            transient,
                        )
                    )
    return options


@functools.cache
def auto_parallel(
    task: ModelTask, cluster: ClusterSpec, wl: WorkloadSpec, n: int, limits: EngineLimits = UNCONSTRAINED
) -> tuple[ModelOption, ...]:
    """Pareto front of `task`'s options on n devices within the engines' `limits`, fastest first;
    empty if nothing fits.

    front[0] is the paper's auto_parallel answer (lowest simulated latency); the rest trade speed
    for memory and are used only when colocated models would not fit otherwise.
    """
    return tuple(_pareto(enumerate_options(task, cluster, wl, n, limits)))


def clear_caches() -> None:
    for f in (auto_parallel, _train_time, _infer_time, _generation_layouts):
        f.cache_clear()
