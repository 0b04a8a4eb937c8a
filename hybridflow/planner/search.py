"""The auto-mapping search (paper Alg. 1): placements x device allocations x parallel configs.

1. Placements are the set partitions of the models (Bell numbers: 4 models -> 15, 5 -> 52). The
   models of one set share a device pool (colocated); different sets run in parallel.
2. For each set and device count n, `pool_choice` picks one `auto_parallel` option per model so the
   pool fits in memory with the least total latency; its per-stage cost is the sum over its models.
   The smallest n that fits is the set's minimum allocation.
3. Allocations give each set n_j >= its minimum with sum(n_j) <= N. Iteration cost =
   sum over stages of max over sets of the set's stage cost, plus the step's rest (`step_rest`: the
   driver's calls, each waiting for every rank of the largest set).

Same search space as the paper, made fast without losing the optimum:
- per set, an n is dropped when a smaller n' costs no more in every stage (n' fits inside n's budget
  and no stage max can grow), which removes awkward counts such as primes;
- allocations are explored by branch and bound: the lower bound of a partial allocation takes, for
  each unassigned set, the stage-wise cheapest cost over every count it could still receive; the last
  two sets are evaluated together as one numpy grid.
`exhaustive_allocation` is the plain enumeration the tests compare against. Allowing sum < N (idle
devices) is a small departure from the paper: it makes "more devices is never slower" hold.
`EngineLimits` (default: none) restricts every model's layouts to what the executing engines run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hybridflow.planner import simulate as sim
from hybridflow.planner.dataflow import STAGES, Dataflow, ModelTask
from hybridflow.planner.parallel import UNCONSTRAINED, ModelOption, auto_parallel
from hybridflow.planner.specs import ClusterSpec, EngineLimits, WorkloadSpec

Placement = tuple[tuple[str, ...], ...]  # e.g. (("actor", "reference"), ("critic", "reward"))


def set_partitions(items: Sequence) -> Iterator[tuple[tuple, ...]]:
    """All partitions of `items` into non-empty sets, in a fixed order (first: everything together)."""
    items = list(items)
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        # put `first` into each existing set, or alone; sets keep the items' original order
        for i in range(len(part)):
            yield tuple(((first, *s) if j == i else s) for j, s in enumerate(part))
        yield ((first,), *part)


def bell_number(n: int) -> int:
    row = [1]
    for _ in range(n):
        nxt = [row[-1]]
        for v in row:
            nxt.append(nxt[-1] + v)
        row = nxt
    return row[0]


def pool_choice(
    tasks: tuple[ModelTask, ...],
    cluster: ClusterSpec,
    wl: WorkloadSpec,
    n: int,
    limits: EngineLimits = UNCONSTRAINED,
) -> tuple[ModelOption, ...] | None:
    """One option per colocated model on n shared devices: least summed latency that fits, or None.

    Fits = sum of persistent bytes + the largest transient peak <= usable memory (they run in turn).
    Depth-first over each model's Pareto front with latency and memory bounds; usually the first
    leaf (everyone's fastest option) fits and the search stops there.
    """
    fronts = [auto_parallel(t, cluster, wl, n, limits) for t in tasks]
    if any(not f for f in fronts):
        return None
    budget = cluster.device.memory_bytes * cluster.device.usable_memory_fraction
    k = len(fronts)
    min_time = [min(o.total_time for o in f) for f in fronts]
    min_pers = [min(o.persistent_bytes for o in f) for f in fronts]
    min_trans = [min(o.transient_bytes for o in f) for f in fronts]
    rest_time = [sum(min_time[i:]) for i in range(k + 1)]
    rest_pers = [sum(min_pers[i:]) for i in range(k + 1)]
    rest_trans = [max(min_trans[i:], default=0.0) for i in range(k + 1)]
    best: list = [math.inf, None]

    def dfs(i: int, time: float, pers: float, trans: float, chosen: tuple):
        if time + rest_time[i] >= best[0] or pers + rest_pers[i] + max(trans, rest_trans[i]) > budget:
            return
        if i == k:
            best[0], best[1] = time, chosen
            return
        for o in fronts[i]:
            dfs(
                i + 1,
                time + o.total_time,
                pers + o.persistent_bytes,
                max(trans, o.transient_bytes),
                (*chosen, o),
            )

    dfs(0, 0.0, 0.0, 0.0, ())
    return best[1]


def pool_stage_costs(choice: Sequence[ModelOption]) -> np.ndarray:
    """(n_stages,) seconds the pool is busy in each stage (its models run one after another)."""
    return np.array([sum(o.stage_times[s] for o in choice) for s in range(len(STAGES))])


@dataclass
class PoolCandidates:
    """Device counts worth giving one set, ascending, with the set's stage costs at each."""

    roles: tuple[str, ...]
    ns: np.ndarray  # (m,) int
    costs: np.ndarray  # (m, n_stages)
    choices: list  # (m,) tuple of ModelOption per n


def on_spare_cores(choice: tuple[ModelOption, ...], cluster: ClusterSpec, n: int) -> tuple[ModelOption, ...]:
    """`choice` on n CPU devices of a pool that runs alone (a one-pool placement): its ranks split the
    node's idle cores too (controller/process.cpu_threads), so its preparation and training run
    thread_speedup faster. Generation is left as priced: the built-in engine decodes small models on one
    thread whatever it is given (rollout/engine.py)."""
    dev = cluster.device
    threads = sim.spare_core_threads(dev, cluster.devices_per_node, n)
    if threads == 1:
        return choice
    infer = sim.thread_speedup(dev.thread_fraction_infer, threads)
    train = sim.thread_speedup(dev.thread_fraction_train, threads)
    speedup = dict(zip(STAGES, (1.0, infer, train)))
    return tuple(
        replace(o, stage_times=tuple(t / speedup[s] for s, t in zip(STAGES, o.stage_times))) for o in choice
    )


def pool_candidates(
    tasks: tuple[ModelTask, ...],
    cluster: ClusterSpec,
    wl: WorkloadSpec,
    max_devices: int,
    prune: bool = True,
    limits: EngineLimits = UNCONSTRAINED,
    alone: bool = False,
) -> PoolCandidates:
    """alone: the pool is the placement's only one, so on CPU its ranks get the cores it leaves idle."""
    ns, costs, choices = [], [], []
    for n in range(1, max_devices + 1):
        choice = pool_choice(tasks, cluster, wl, n, limits)
        if choice is not None and alone:
            choice = on_spare_cores(choice, cluster, n)
        if choice is not None:
            ns.append(n)
            costs.append(pool_stage_costs(choice))
            choices.append(choice)
    ns_arr = np.array(ns, dtype=np.int64)
    cost_arr = np.array(costs, dtype=np.float64).reshape(len(ns), len(STAGES))
    if prune and len(ns):
        # n is dropped when a smaller count is at least as fast in every stage
        le = np.all(cost_arr[:, None, :] <= cost_arr[None, :, :], axis=2)  # le[j, i]: j no worse than i
        keep = ~np.any(np.triu(le, k=1), axis=0)  # any smaller j (row) beating i (column)
        ns_arr, cost_arr = ns_arr[keep], cost_arr[keep]
        choices = [c for c, k in zip(choices, keep) if k]
    return PoolCandidates(tuple(t.role for t in tasks), ns_arr, cost_arr, choices)


def _prefix_min(c: PoolCandidates, N: int) -> np.ndarray:
    """(N+1, n_stages): stage-wise cheapest cost over counts <= r (inf where none fits)."""
    out = np.full((N + 1, c.costs.shape[1]), np.inf)
    cur = np.full(c.costs.shape[1], np.inf)
    j = 0
    for r in range(N + 1):
        while j < len(c.ns) and c.ns[j] <= r:
            cur = np.minimum(cur, c.costs[j])
            j += 1
        out[r] = cur
    return out


def _rest_by_count(rest: np.ndarray | None, N: int, cands: Sequence[PoolCandidates]) -> np.ndarray:
    """`rest` (none: 0 at every count) indexable by every count a candidate has; counts above N are never
    chosen, so they take N's."""
    rest = np.zeros(N + 1) if rest is None else rest
    top = max((int(c.ns[-1]) for c in cands if len(c.ns)), default=0)
    return np.pad(rest, (0, max(0, top + 1 - len(rest))), mode="edge")


def best_allocation(
    cands: Sequence[PoolCandidates], N: int, rest: np.ndarray | None = None
) -> tuple[float, tuple[int, ...]] | None:
    """Cheapest (cost, index into each set's candidates) with total devices <= N, or None. `rest` (N + 1,):
    what the step pays beyond its stages when its largest pool has n devices (step_rest: each call waits
    for every rank of the group it reaches), non-decreasing in n; it is part of the cost (default none)."""
    rest = _rest_by_count(rest, N, cands)
    k = len(cands)
    if any(len(c.ns) == 0 for c in cands) or sum(int(c.ns[0]) for c in cands) > N:
        return None
    # branch over the sets with few candidates, grid-evaluate the two with the most
    order = sorted(range(k), key=lambda j: (len(cands[j].ns), j))
    cs = [cands[j] for j in order]
    min_n = [int(c.ns[0]) for c in cs]
    prefix = [_prefix_min(c, N) for c in cs]
    S = cs[0].costs.shape[1]
    if k >= 2:
        a, b = cs[-2], cs[-1]
        pair_max = np.maximum(a.costs[:, None, :], b.costs[None, :, :])  # (ma, mb, S)
        pair_n = a.ns[:, None] + b.ns[None, :]
        pair_largest = np.maximum(a.ns[:, None], b.ns[None, :])
    best = [math.inf, None]

    def leaf(remaining: int, cur: np.ndarray, largest: int, chosen: tuple):
        if k == 1:
            cost = np.maximum(cs[0].costs, cur).sum(axis=1) + rest[cs[0].ns]
            cost[cs[0].ns > remaining] = np.inf
            i = int(np.argmin(cost))
            if cost[i] < best[0]:
                best[0], best[1] = float(cost[i]), (i,)
            return
        cost = np.maximum(pair_max, cur).sum(axis=2) + rest[np.maximum(pair_largest, largest)]
        cost[pair_n > remaining] = np.inf
        flat = int(np.argmin(cost))
        if cost.flat[flat] < best[0]:
            ia, ib = divmod(flat, cost.shape[1])
            best[0], best[1] = float(cost.flat[flat]), (*chosen, ia, ib)

    def rec(level: int, remaining: int, cur: np.ndarray, largest: int, chosen: tuple):
        if level >= k - 2:
            leaf(remaining, cur, largest, chosen)
            return
        c = cs[level]
        later = min_n[level + 1 :]
        for i, n in enumerate(c.ns):
            rem = remaining - int(n)
            if rem < sum(later):
                break
            new = np.maximum(cur, c.costs[i])
            lb = new
            for off, later_set in enumerate(range(level + 1, k)):
                r_l = rem - (sum(later) - later[off])
                lb = np.maximum(lb, prefix[later_set][r_l])
            if lb.sum() + rest[max(largest, int(n))] >= best[0]:  # the rest only grows with later pools
                continue
            rec(level + 1, rem, new, max(largest, int(n)), (*chosen, i))

    rec(0, N, np.zeros(S), 0, ())
    if best[1] is None:
        return None
    idx = [0] * k
    for pos, j in enumerate(order):
        idx[j] = best[1][pos]
    return best[0], tuple(idx)


def exhaustive_allocation(
    cands: Sequence[PoolCandidates], N: int, rest: np.ndarray | None = None
) -> tuple[float, tuple[int, ...]] | None:
    """Reference for tests: every combination of counts with sum <= N, no bounds (small N only).

    The whole product of the sets' candidate lists is materialised as one numpy grid.
    """
    if any(len(c.ns) == 0 for c in cands):
        return None
    rest = _rest_by_count(rest, N, cands)
    k = len(cands)
    shape = [len(c.ns) for c in cands]
    total_n = np.zeros(shape, dtype=np.int64)
    largest = np.zeros(shape, dtype=np.int64)
    stage_max = np.zeros([*shape, cands[0].costs.shape[1]])
    for j, c in enumerate(cands):
        view = [1] * k
        view[j] = len(c.ns)
        total_n = total_n + c.ns.reshape(view)
        largest = np.maximum(largest, c.ns.reshape(view))
        stage_max = np.maximum(stage_max, c.costs.reshape([*view, -1]))
    cost = stage_max.sum(axis=-1) + rest[largest]
    cost[total_n > N] = np.inf
    flat = int(np.argmin(cost))
    if not np.isfinite(cost.flat[flat]):
        return None
    return float(cost.flat[flat]), tuple(int(i) for i in np.unravel_index(flat, shape))


@dataclass
class PlacementResult:
    """The best allocation for one placement."""

    placement: Placement
    iteration_time: float
    allocation: tuple[int, ...]  # devices per set
    choices: tuple[tuple[ModelOption, ...], ...]  # per set, per model
    stage_times: tuple[float, ...]  # per stage: max over sets


def search_placement(
    dataflow: Dataflow,
    placement: Placement,
    cluster: ClusterSpec,
    wl: WorkloadSpec,
    cache: dict | None = None,
    limits: EngineLimits = UNCONSTRAINED,
    rest: np.ndarray | None = None,
) -> PlacementResult | None:
    """Best allocation and configs for one placement, or None if it cannot fit on the cluster. The
    allocation is chosen with the step's rest (`rest`, rests_by_ranks' by default: a call to a larger pool
    waits for more ranks); the result's iteration_time is its stages' (plan.build_plan adds the rest).

    `cache` maps a set's roles to its candidates; share it, and `rest`, only between calls with the same
    inputs.
    """
    cache = {} if cache is None else cache
    cands = []
    for roles in placement:
        if roles not in cache:
            tasks = tuple(dataflow.model(r) for r in roles)
            cache[roles] = pool_candidates(
                tasks, cluster, wl, cluster.num_devices, limits=limits, alone=len(placement) == 1
            )
        cands.append(cache[roles])
    rest = rests_by_ranks(dataflow, cluster, wl) if rest is None else rest
    found = best_allocation(cands, cluster.num_devices, rest)
    if found is None:
        return None
    _, idx = found
    choices = tuple(c.choices[i] for c, i in zip(cands, idx))
    stage = np.max([c.costs[i] for c, i in zip(cands, idx)], axis=0)
    alloc = tuple(int(c.ns[i]) for c, i in zip(cands, idx))
    return PlacementResult(placement, float(stage.sum()), alloc, choices, tuple(float(x) for x in stage))


def step_rest(dataflow: Dataflow, cluster: ClusterSpec, wl: WorkloadSpec, ranks: int) -> float:
    """The step's rest (simulate.step_rest_time) with a call for each stage `dataflow`'s models work in, to
    groups of `ranks` ranks (a placement's largest pool: each call waits for every rank it reaches)."""
    stages = tuple(s for s in STAGES if any(stage == s for m in dataflow.models for stage, _ in m.work))
    factor = max((m.generation_factor for m in dataflow.models if m.generates), default=1.0)
    return sim.step_rest_time(cluster.device, wl, stages, factor, max(ranks, 1))


def rests_by_ranks(dataflow: Dataflow, cluster: ClusterSpec, wl: WorkloadSpec) -> np.ndarray:
    """(N + 1,): step_rest with a largest pool of n = 0..N devices (0 prices as 1), the same for every
    placement of `dataflow` on `cluster`."""
    return np.array([step_rest(dataflow, cluster, wl, n) for n in range(cluster.num_devices + 1)])


def search(
    dataflow: Dataflow, cluster: ClusterSpec, wl: WorkloadSpec, limits: EngineLimits = UNCONSTRAINED
) -> list[PlacementResult]:
    """The best result of every feasible placement within the engines' `limits`, cheapest first
    (ties: fewer sets, then order)."""
    cache: dict = {}
    rest = rests_by_ranks(dataflow, cluster, wl)
    results = []
    for order, placement in enumerate(set_partitions(dataflow.roles)):
        r = search_placement(dataflow, placement, cluster, wl, cache, limits, rest)
        if r is not None:
            # equal costs (e.g. reference and reward of the same size swapped) go to the paper's named
            # strategies first; rounding keeps float summation order from deciding a tie
            named = _named_rank(placement, dataflow.roles)
            results.append((round(r.iteration_time, 9), named, len(placement), order, r))
    results.sort(key=lambda x: x[:4])
    return [x[-1] for x in results]


def strategy_name(placement: Sequence[Sequence[str]], roles: Sequence[str]) -> str:
    """The paper's names for fixed placements (sec. 8.4); anything else is 'custom'."""
    sets = sorted(sorted(s) for s in placement)
    if len(sets) == 1:
        return "colocate"
    if len(sets) == len(roles):
        return "standalone"
    if sets == sorted(sorted(s) for s in split_placement(roles)):
        return "split"
    return "custom"


def split_placement(roles: Sequence[str]) -> list[list[str]]:
    """NeMo-Aligner's split: the policy side (actor, reference) and the scoring side (the rest)."""
    policy = [r for r in roles if r in ("actor", "reference")]
    return [policy, [r for r in roles if r not in policy]]


def _named_rank(placement: Placement, roles: tuple[str, ...]) -> int:
    return ("colocate", "split", "standalone", "custom").index(strategy_name(placement, roles))
