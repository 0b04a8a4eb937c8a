"""The one-step-ahead schedule (`trainer.rollout_ahead: 1`, docs/planner.md): generation on its own pool.

With `rollout_ahead = 1` the devices are split in two: a rollout pool that only generates, and a
training side where every other model's work runs (the actor's update, and its preparation forward
where the dataflow has one: with one optimizer step the trainer's rollout_ahead=1 takes the old log-probs
from the update's own forward unless KL is in the reward, dataflow.old_log_prob_work; critic,
reference, reward: any placement of them, searched as usual). The rollout pool generates step
k+1's responses while the training side prepares and trains on step k, then the actor's new weights
are sent to the rollout pool. In steady state one iteration takes

    max(generation on the rollout pool + weight sync, preparation + training on the training side
        + the share of the sync actor rank 0 waits for)

against the synchronous schedule's generation + preparation + training on all devices. Generation
needs no hybrid-engine switch here (the rollout pool keeps its own copy of the weights), and its pool
holds only the generation weights and the KV cache; the training side holds no KV cache.
By default each rollout device holds and is sent only its generation shard, 1/(pg*tg) of the weights,
as the built-in trainer's rollout pool does (rollout/pool_tp.py, workers/shard_sync.py);
EngineLimits.rollout_full_weights (`hybridflow plan --rollout-full-weights`) prices ranks that hold and
receive the whole model instead, for an engine whose loader slices the full weights itself.

The frozen models (reference, reward, cost: they never train) may run on the rollout pool instead
(`frozen_pool="rollout"`, the trainer's resources.frozen_pool default): they score batch k+1 there right
after generating it, so the rollout side costs generation + their forwards (data parallel over the pool,
their weights beside the generation's) and the training side keeps only the actor and the critic:

    max(generation + frozen forwards + sync, actor preparation + training + its share of the sync)

With `frozen_pool="both"` the reference is in both (reward and cost on the rollout pool), and a
fraction of each batch's rows is scored on each side to even them (ahead_both.py).

Ahead wins where generation and training take similar time and generation scales poorly with devices
(memory-bound decode re-reads the weights on every replica); it loses where one phase dominates and
would rather have all the devices, or where the weight sync crosses a slow network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridflow.hybrid_engine.sync_budget import SEND_INFLIGHT_BYTES
from hybridflow.planner import memory as mem
from hybridflow.planner import simulate as sim
from hybridflow.planner.ahead_both import best_both_split
from hybridflow.planner.dataflow import Dataflow, ModelTask
from hybridflow.planner.parallel import UNCONSTRAINED, _powers_of_two_upto
from hybridflow.planner.search import PlacementResult, best_allocation, pool_candidates, set_partitions
from hybridflow.planner.specs import ClusterSpec, EngineLimits, WorkloadSpec

ROLLOUT_POOL = "rollout"
FROZEN = ("reference", "reward", "cost")  # planner roles that never train: they may score on the rollout pool
# "both": the reference on both sides, its rows split (ahead_both.py); search_ahead also takes "auto":
# whichever predicts the shorter iteration
FROZEN_POOLS = ("rollout", "training", "both")


def ahead_iteration_seconds(
    generation: float, training_side: float, sync: float, sender_waits: float = 1.0
) -> float:
    """Steady-state iteration of the one-step-ahead schedule: the two sides overlap; the rollout side
    waits for the whole weight sync before generating, the training side only for the `sender_waits`
    fraction of it that its rank 0 cannot leave in flight behind the next update (sender_wait_fraction)."""
    return max(generation + sync, training_side + sender_waits * sync)


def sender_wait_fraction(task: ModelTask, cluster: ClusterSpec) -> float:
    """The share of a sync actor rank 0 waits for: it issues the broadcasts and trains on while at most
    SEND_INFLIGHT_BYTES of its packed buckets are in flight (workers/weight_sync.py); the rest it waits
    for as they are sent."""
    total = task.spec.num_params * cluster.device.bytes_per_param
    return max(0.0, 1.0 - SEND_INFLIGHT_BYTES / total) if total else 0.0


@dataclass(frozen=True)
class RolloutOption:
    """The rollout pool's generation layout on n devices and its cost."""

    n_devices: int
    pg: int
    tg: int
    waves: int  # generation rounds per replica (1: the KV cache holds all its sequences)
    generation_seconds: float
    weight_bytes: float  # per device: the generation shard of the weights
    kv_bytes: float  # per device: the KV cache of one wave


def weight_sync_bytes(task: ModelTask, cluster: ClusterSpec, pg: int, tg: int) -> float:
    """Bytes one rollout device receives per sync: its generation shard of the actor's weights."""
    return task.spec.num_params * cluster.device.bytes_per_param / (pg * tg)


def weight_sync_seconds(task: ModelTask, cluster: ClusterSpec, n_rollout: int, pg: int, tg: int) -> float:
    """Time to send the actor's weights to a rollout pool of n_rollout devices laid out as (pg, tg).

    Inside one node each device receives its shard over the intra-node links. When the cluster spans
    nodes the pools may sit on different nodes, so each rollout node also receives, through its NIC,
    the distinct shards its devices hold (the whole model once it holds a full replica) and fans them
    out inside the node; the slower of the two paths sets the time. Plus a tree's latency.
    """
    dev, dpn = cluster.device, cluster.devices_per_node
    shard = weight_sync_bytes(task, cluster, pg, tg)
    seconds = shard / (dev.intra_node_bandwidth * dev.comm_efficiency)
    if cluster.num_devices > dpn:
        per_node = min(dpn, n_rollout)
        node_bytes = task.spec.num_params * dev.bytes_per_param * min(per_node, pg * tg) / (pg * tg)
        seconds = max(seconds, node_bytes / (dev.inter_node_bandwidth * dev.comm_efficiency))
    return seconds + math.ceil(math.log2(n_rollout + 1)) * dev.comm_latency_s


def rollout_option(
    task: ModelTask,
    cluster: ClusterSpec,
    wl: WorkloadSpec,
    n: int,
    limits: EngineLimits = UNCONSTRAINED,
    reserved_bytes: float = 0.0,
) -> RolloutOption | None:
    """The fastest generation layout (pg, tg, waves) of `task` on n devices that fits beside
    `reserved_bytes` per device (the frozen models' weights when they run there), or None."""
    dev, dpn, spec = cluster.device, cluster.devices_per_node, task.spec
    budget = dev.memory_bytes * dev.usable_memory_fraction - reserved_bytes
    best = None
    for tg in _powers_of_two_upto(min(n, dpn, limits.max_rollout_tg or n)):
        if not limits.allows_tp(spec, tg):
            continue
        for pg in range(1, min(spec.num_layers, limits.max_pg or n) + 1):
            if spec.num_layers % pg or n % (pg * tg):
                continue
            held = (1, 1) if limits.rollout_full_weights else (pg, tg)
            weights = mem.weight_bytes(spec, dev.bytes_per_param, *held)
            per_replica = -(-int(wl.sequences * task.generation_factor) // (n // (pg * tg)))
            waves = 1
            while True:
                concurrent = -(-per_replica // waves)
                kv = mem.kv_cache_bytes(spec, dev.bytes_per_param, concurrent, wl.seq_len, pg, tg)
                if weights + kv <= budget:
                    gen = sim.generation_time(spec, dev, wl, dpn, n, pg, tg, task.generation_factor, waves)
                    # its call is the rollout pool's, overlapping the step (not in the step's rest)
                    gen += sim.stage_call_time(dev, wl, "generation", task.generation_factor)
                    option = RolloutOption(n, pg, tg, waves, gen, weights, kv)
                    if best is None or gen < best.generation_seconds:
                        best = option
                    break  # more waves only add time
                if concurrent == 1:
                    break
                waves *= 2
    return best


def training_side(dataflow: Dataflow, frozen_pool: str = "training") -> Dataflow:
    """The dataflow without generation: the actor keeps its update (and its preparation forward where
    `dataflow.old_log_probs` is "actor"); with frozen_pool="rollout" the frozen models are left out too
    (they score on the rollout pool), with "both" all but the reference (it scores on both sides)."""
    if frozen_pool not in FROZEN_POOLS:
        raise ValueError(f"frozen_pool must be one of {FROZEN_POOLS}, got {frozen_pool!r}")
    models = tuple(
        replace(m, work=tuple(w for w in m.work if w[1] != "generate"), generation_factor=1.0)
        if m.generates
        else m
        for m in dataflow.models
        if frozen_pool == "training"
        or m.role not in FROZEN
        or (frozen_pool == "both" and m.role == "reference")
    )
    return Dataflow(dataflow.algorithm, models, dataflow.old_log_probs)


def frozen_tasks(dataflow: Dataflow, frozen_pool: str) -> tuple[ModelTask, ...]:
    """The models that score on the rollout pool (none with frozen_pool="training"; with "both" the
    reference among them, on its share of the rows)."""
    return tuple(m for m in dataflow.models if m.role in FROZEN) if frozen_pool != "training" else ()


def scoring_seconds(tasks: tuple[ModelTask, ...], cluster: ClusterSpec, wl: WorkloadSpec, n: int) -> float:
    """The frozen models' forwards over the batch on a rollout pool of n devices, one after another
    (they share its processes), each data parallel over the pool."""
    dev, dpn = cluster.device, cluster.devices_per_node
    call = sim.stage_call_time(dev, wl, "preparation")  # each its own call, after generation on that pool
    return sum(sim.inference_time(m.spec, dev, wl, dpn, 1, 1, n) + call for m in tasks)


def frozen_bytes(tasks: tuple[ModelTask, ...], cluster: ClusterSpec) -> float:
    """Per rollout device: the frozen models' whole weights (data parallel: each rank holds them all)."""
    return sum(mem.weight_bytes(m.spec, cluster.device.bytes_per_param, 1, 1) for m in tasks)


@dataclass
class AheadResult:
    """The best one-step-ahead plan: the rollout pool, and the training side's best placement on
    the remaining devices (its generation stage is 0)."""

    rollout: RolloutOption
    train: PlacementResult
    sync_seconds: float
    sync_bytes: float  # per rollout device, per iteration
    frozen_pool: str = "training"  # where the frozen models run ("rollout": priced on the rollout side)
    frozen: tuple[str, ...] = ()  # the frozen models on the rollout pool
    scoring_seconds: float = 0.0  # their forwards there, after generation ("both": the reference's share)
    sender_waits: float = 1.0  # the share of the sync the training side waits for (sender_wait_fraction)
    old_log_probs: str = "actor"  # the searched dataflow's: is the actor's preparation forward priced
    # frozen_pool="both" (ahead_both.py): the fraction of the rows the rollout pool's reference scores, and
    # the reference's forward over the whole batch on each side (train includes R_train in full)
    ref_rows_on_rollout: float = 0.0
    ref_rollout_seconds: float = 0.0
    ref_training_seconds: float = 0.0

    @property
    def rollout_side_seconds(self) -> float:
        return self.rollout.generation_seconds + self.scoring_seconds

    @property
    def training_side_seconds(self) -> float:
        """The training side's work: its placement's iteration less the reference's rows scored on the
        rollout pool (frozen_pool="both")."""
        return self.train.iteration_time - self.ref_rows_on_rollout * self.ref_training_seconds

    @property
    def iteration_time(self) -> float:
        return ahead_iteration_seconds(
            self.rollout_side_seconds, self.training_side_seconds, self.sync_seconds, self.sender_waits
        )


def best_split(
    generation, training, sync, num_devices: int, sender_waits: float = 1.0
) -> tuple[float, int] | None:
    """(iteration seconds, rollout devices) minimising max(generation(n), training(N - n)) + sync(n)
    over n = 1..N-1, or None. `generation(n)` and `sync(n)` map a device count to seconds (None: does
    not fit); `training(m, limit)` gives the training side's seconds on m devices, or None when it does
    not fit or cannot beat `limit` (the search passes what would still improve the best split).
    Assumes, as the simulator gives, that training(m) does not grow with m (idle devices are allowed)
    and sync(n) does not shrink with n, so the scan stops once training(N - n) + sender_waits * sync(n) reaches
    the best found."""
    best = None
    for n in range(1, num_devices):
        s = sync(n)
        train_s = training(num_devices - n, math.inf if best is None else best[0] - sender_waits * s)
        if train_s is None or not math.isfinite(train_s):
            break  # fewer devices for the training side, more sync: no later n can do better
        g = generation(n)
        if g is None or not math.isfinite(g):
            continue
        cost = ahead_iteration_seconds(g, train_s, s, sender_waits)
        if best is None or cost < best[0]:
            best = (cost, n)
    return best


def search_ahead(
    dataflow: Dataflow,
    cluster: ClusterSpec,
    wl: WorkloadSpec,
    limits: EngineLimits = UNCONSTRAINED,
    rollout_devices: int | None = None,
    frozen_pool: str = "training",
) -> AheadResult | None:
    """The fastest one-step-ahead plan of `dataflow` on `cluster`, or None (one device, or nothing fits);
    `rollout_devices` fixes the rollout pool's size (a user's resources.rollout_devices), else searched;
    `frozen_pool` places the frozen models ("training": searched with the training side; "rollout":
    priced on the rollout side, after generation; "both": the reference on both sides, its rows split,
    ahead_both.py; "auto": the fastest of them, "both" only where the dataflow has a reference).

    The training side's placements and allocations are searched exactly as the synchronous schedule's
    (search.py), for every device count the rollout pool leaves; candidates are computed once.
    """
    if frozen_pool == "auto":
        return _search_ahead_auto(dataflow, cluster, wl, limits, rollout_devices)
    both = frozen_pool == "both"
    if both and "reference" not in dataflow.roles:
        raise ValueError(_NO_REFERENCE.format(dataflow.algorithm, dataflow.roles))
    n_total = cluster.num_devices
    actor = next((m for m in dataflow.models if m.generates), None)
    if n_total < 2 or actor is None:
        return None
    frozen = frozen_tasks(dataflow, frozen_pool)
    side = _TrainingSide(training_side(dataflow, frozen_pool), cluster, wl, limits, both)
    rollout_memo = _rollout_options(
        actor, cluster, wl, limits, frozen_bytes(frozen, cluster), rollout_devices
    )
    others = tuple(m for m in frozen if not both or m.role != "reference")  # scored whole on the rollout pool
    refs = tuple(m for m in frozen if m.role == "reference") if both else ()

    def sync_of(n: int) -> float:
        return weight_sync_seconds(actor, cluster, n, *_sync_layout(rollout_memo[n], limits))

    def rollout_side(n: int) -> float | None:
        r = rollout_memo[n]
        return r.generation_seconds + scoring_seconds(others, cluster, wl, n) if r else None

    waits = sender_wait_fraction(actor, cluster)
    if both:
        split = best_both_split(
            lambda n: (
                None if rollout_side(n) is None else (rollout_side(n), scoring_seconds(refs, cluster, wl, n))
            ),
            lambda m: None if (r := side.best(m)) is None else (r[0], side.ref_seconds(r)),
            sync_of,
            n_total,
            waits,
        )
    else:
        split = best_split(
            rollout_side, lambda m, limit: (side.best(m, limit) or (None,))[0], sync_of, n_total, waits
        )
    if split is None:
        return None
    n_rollout = split[1]
    f = split[2] if both else 0.0
    option, found = rollout_memo[n_rollout], side.found_at[n_total - n_rollout]
    layout = _sync_layout(option, limits)
    r_roll = scoring_seconds(refs, cluster, wl, n_rollout)
    return AheadResult(
        option,
        side.placement_result(found),
        weight_sync_seconds(actor, cluster, n_rollout, *layout),
        weight_sync_bytes(actor, cluster, *layout),
        frozen_pool,
        tuple(m.role for m in frozen),
        scoring_seconds(others, cluster, wl, n_rollout) + f * r_roll,
        waits,
        dataflow.old_log_probs,
        f,
        r_roll,
        side.ref_seconds(found) if both else 0.0,
    )


_NO_REFERENCE = (
    "frozen_pool both splits the reference's rows, and {}'s dataflow {} has no reference; use rollout, "
    "training or auto"
)


def _rollout_options(actor, cluster, wl, limits, reserved: float, rollout_devices: int | None) -> dict:
    """Rollout pool size n -> its RolloutOption (None: does not fit, or not the size the user fixed)."""
    n_total = cluster.num_devices
    sizes = (
        range(1, n_total) if not rollout_devices else [rollout_devices] if rollout_devices < n_total else []
    )
    return {
        n: rollout_option(actor, cluster, wl, n, limits, reserved) if n in sizes else None
        for n in range(1, n_total)
    }


def _search_ahead_auto(dataflow, cluster, wl, limits, rollout_devices) -> AheadResult | None:
    """frozen_pool "auto": the fastest of "rollout" and "training", and "both" where it is strictly faster."""
    found = [search_ahead(dataflow, cluster, wl, limits, rollout_devices, f) for f in ("rollout", "training")]
    best = min((r for r in found if r is not None), key=lambda r: r.iteration_time, default=None)
    has_ref = "reference" in dataflow.roles
    split = search_ahead(dataflow, cluster, wl, limits, rollout_devices, "both") if has_ref else None
    # "both" holds the reference twice: only for a strictly shorter iteration (a tie is f = 0 or 1)
    if split is not None and (best is None or split.iteration_time < best.iteration_time * (1 - 1e-9)):
        return split
    return best


class _TrainingSide:
    """The training side's search: every placement of its roles, each pool's candidates computed once (for
    the most devices it can get, N - 1); `best(m)` the fastest placement and allocation on m devices."""

    def __init__(
        self, side: Dataflow, cluster: ClusterSpec, wl: WorkloadSpec, limits: EngineLimits, both: bool
    ):
        n_most = cluster.num_devices - 1
        placements = list(set_partitions(side.roles))
        if both:  # the training side's reference joins the actor's workers (trainers/placement.py)
            placements = [pl for pl in placements if any({"actor", "reference"} <= set(s) for s in pl)]
        self.cache: dict = {}
        for placement in placements:
            for roles in placement:
                if roles not in self.cache:
                    tasks = tuple(side.model(r) for r in roles)
                    self.cache[roles] = pool_candidates(tasks, cluster, wl, n_most, limits=limits)
        # a placement's cost on N - 1 devices bounds it from below on fewer: try the cheap ones first
        floor = {pl: best_allocation([self.cache[r] for r in pl], n_most) for pl in placements}
        self.ranked = sorted((f[0], i, pl) for i, (pl, f) in enumerate(floor.items()) if f is not None)
        self.found_at: dict[int, tuple[float, tuple, tuple]] = {}

    def best(self, m: int, limit: float = math.inf) -> tuple[float, tuple, tuple] | None:
        """The best (seconds, placement, allocation index) on m devices below `limit`, kept in found_at."""
        found = None
        for lower, _, placement in self.ranked:
            if lower >= limit:
                break
            r = best_allocation([self.cache[roles] for roles in placement], m)
            if r is not None and r[0] < limit:
                limit, found = r[0], (r[0], placement, r[1])
        if found is not None:
            self.found_at[m] = found
        return found

    def ref_seconds(self, found) -> float:
        """The reference's forward in the placement `found` (best's)."""
        _, placement, idx = found
        picked = (self.cache[roles].choices[i] for roles, i in zip(placement, idx))
        return sum(sum(o.stage_times) for choice in picked for o in choice if o.role == "reference")

    def placement_result(self, found) -> PlacementResult:
        cost, placement, idx = found
        cands = [self.cache[roles] for roles in placement]
        choices = tuple(c.choices[i] for c, i in zip(cands, idx))
        stage = [max(c.costs[i][s] for c, i in zip(cands, idx)) for s in range(cands[0].costs.shape[1])]
        alloc = tuple(int(c.ns[i]) for c, i in zip(cands, idx))
        return PlacementResult(placement, cost, alloc, choices, tuple(float(x) for x in stage))


def _sync_layout(option: RolloutOption | None, limits: EngineLimits) -> tuple[int, int]:
    """(pg, tg) whose shard a rollout device is sent: the whole model when it holds full weights."""
    return (option.pg, option.tg) if option and not limits.rollout_full_weights else (1, 1)
