"""Search: set partitions, the allocation branch and bound against plain enumeration, pool choices."""

from __future__ import annotations

import numpy as np
import pytest

from hybridflow.planner import (
    ClusterSpec,
    ModelSpec,
    WorkloadSpec,
    bell_number,
    build_dataflow,
    set_partitions,
)
from hybridflow.planner.parallel import enumerate_options
from hybridflow.planner.search import (
    best_allocation,
    exhaustive_allocation,
    pool_candidates,
    pool_choice,
    search,
)


@pytest.mark.parametrize("n, expected", [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52)])
def test_set_partitions_are_the_bell_numbers(n, expected):
    parts = list(set_partitions(range(n)))
    assert len(parts) == expected == bell_number(n)
    canon = {frozenset(frozenset(s) for s in p) for p in parts}
    assert len(canon) == expected  # all distinct
    for p in parts:  # each is a partition: every item exactly once, no empty set
        assert sorted(x for s in p for x in s) == list(range(n))
        assert all(s for s in p)
    assert parts[0] == (tuple(range(n)),)  # everything colocated comes first


def _cluster_and_flow(size, gpus, algorithm="ppo", device="a100-80"):
    return build_dataflow(algorithm, ModelSpec.from_param_count(size)), ClusterSpec.build(device, gpus)


@pytest.mark.parametrize(
    "size, gpus, algorithm",
    [("7B", 16, "ppo"), ("13B", 16, "ppo"), ("70B", 40, "ppo"), ("7B", 14, "safe-rlhf"), ("1B", 10, "grpo")],
)
def test_branch_and_bound_equals_exhaustive_search(size, gpus, algorithm):
    """Pruned search (dominated device counts dropped, bounds) finds exactly the exhaustive optimum."""
    dataflow, cluster = _cluster_and_flow(size, gpus, algorithm)
    wl = WorkloadSpec()
    compared = 0
    for placement in set_partitions(dataflow.roles):
        tasks = [tuple(dataflow.model(r) for r in s) for s in placement]
        pruned = [pool_candidates(t, cluster, wl, gpus, prune=True) for t in tasks]
        full = [pool_candidates(t, cluster, wl, gpus, prune=False) for t in tasks]
        fast = best_allocation(pruned, gpus)
        slow = exhaustive_allocation(full, gpus)
        assert (fast is None) == (slow is None), placement
        if fast is not None:
            compared += 1
            assert fast[0] == pytest.approx(slow[0], rel=1e-12), placement
            assert sum(int(c.ns[i]) for c, i in zip(pruned, fast[1])) <= gpus
    assert compared >= 3


def test_dominance_pruning_drops_exactly_the_dominated_counts():
    dataflow, cluster = _cluster_and_flow("7B", 64)
    wl = WorkloadSpec()
    dropped = 0
    for roles in (dataflow.roles, ("actor",), ("reference",)):
        tasks = tuple(dataflow.model(r) for r in roles)
        full = pool_candidates(tasks, cluster, wl, 64, prune=False)
        kept = pool_candidates(tasks, cluster, wl, 64, prune=True)
        for n, cost in zip(full.ns, full.costs):
            smaller = full.costs[full.ns < n]
            dominated = bool(np.any(np.all(smaller <= cost, axis=1)))
            assert (n not in kept.ns) == dominated, (roles, n)
            dropped += dominated
    assert dropped > 10  # e.g. awkward counts such as 17 or 31 devices for the colocated set


def test_pool_choice_is_the_best_fitting_combination():
    """The depth-first choice over Pareto fronts equals brute force over every option of every model."""
    dataflow, cluster = _cluster_and_flow("13B", 16)
    wl = WorkloadSpec()
    budget = cluster.device.memory_bytes * cluster.device.usable_memory_fraction
    tasks = (dataflow.model("actor"), dataflow.model("critic"), dataflow.model("reward"))
    for n in (8, 16):
        # every combination of every option (not only the Pareto fronts), as one numpy grid
        every = [enumerate_options(t, cluster, wl, n) for t in tasks]
        grids = [
            np.array([(o.total_time, o.persistent_bytes, o.transient_bytes) for o in opts]) for opts in every
        ]
        a, c, r = grids[0][:, None, None], grids[1][None, :, None], grids[2][None, None, :]
        total = a[..., 0] + c[..., 0] + r[..., 0]
        mem = a[..., 1] + c[..., 1] + r[..., 1] + np.maximum(np.maximum(a[..., 2], c[..., 2]), r[..., 2])
        best = np.where(mem <= budget, total, np.inf).min()
        choice = pool_choice(tasks, cluster, wl, n)
        assert np.isfinite(best) and choice is not None
        assert sum(o.total_time for o in choice) == pytest.approx(best, rel=1e-12)
        assert sum(o.persistent_bytes for o in choice) + max(o.transient_bytes for o in choice) <= budget


def test_iteration_cost_is_sum_over_stages_of_max_over_pools(paper_plan):
    p = paper_plan("13B", 128)
    assert len(p.pools) >= 2  # non-colocated here, so the max matters
    for stage, seconds in p.stage_seconds.items():
        per_pool = [sum(p.model(r).stage_seconds[stage] for r in pool.roles) for pool in p.pools]
        assert seconds == pytest.approx(max(per_pool))
    # plus the rest no stage holds: each stage's call and the advantages' (the GPU entry's 5 ms a call and 2 GB/s,
    # every row's 32 bytes a token there and back; generation's calls move the same prompt + response tokens)
    w = p.workload
    tokens = w["prompts"] * w["samples_per_prompt"] * (w["prompt_len"] + w["response_len"])
    assert p.rest_seconds == pytest.approx(4 * (5e-3 + 2 * tokens * 32 / 2e9), rel=1e-12)
    assert p.iteration_seconds == pytest.approx(sum(p.stage_seconds.values()) + p.rest_seconds)
    # alternatives are ranked and the winner is first
    times = [a.iteration_seconds for a in p.alternatives]
    assert times == sorted(times) and times[0] == pytest.approx(p.iteration_seconds)


def test_safe_rlhf_searches_all_52_placements():
    dataflow, cluster = _cluster_and_flow("7B", 32, "safe-rlhf")
    results = search(dataflow, cluster, WorkloadSpec())
    assert len(dataflow.roles) == 5
    assert len(results) == 52  # 32 x 80 GB holds every placement of five 7B models


def test_the_allocation_pays_the_rest_of_its_largest_pool():
    """With a rest that grows with the largest pool's devices (search.step_rest: each call waits for every
    rank it reaches), branch and bound still finds the exhaustive optimum, and a steep enough rest takes
    devices away from a pool whose stages they would shorten."""
    dataflow, cluster = _cluster_and_flow("1B", 10, "grpo")
    wl = WorkloadSpec()
    rng = np.random.default_rng(0)
    for placement in list(set_partitions(dataflow.roles))[:6]:
        tasks = [tuple(dataflow.model(r) for r in s) for s in placement]
        pruned = [pool_candidates(t, cluster, wl, 10, prune=True) for t in tasks]
        full = [pool_candidates(t, cluster, wl, 10, prune=False) for t in tasks]
        for scale in (0.0, 1e-3, 1e-2, 1.0):
            rest = scale * np.cumsum(rng.random(11))  # non-decreasing in the largest pool's count
            fast, slow = best_allocation(pruned, 10, rest), exhaustive_allocation(full, 10, rest)
            assert fast[0] == pytest.approx(slow[0], rel=1e-12), (placement, scale)
    together = (tuple(dataflow.model(r) for r in dataflow.roles),)
    cands = [pool_candidates(together[0], cluster, wl, 10)]
    free = best_allocation(cands, 10)
    assert int(cands[0].ns[free[1][0]]) > 1
    steep = best_allocation(cands, 10, np.arange(11) * 1e3)  # 1000 s a device: one is cheapest
    assert int(cands[0].ns[steep[1][0]]) == int(cands[0].ns[0])
