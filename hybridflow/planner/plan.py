"""The planner's output: a printable, serialisable `Plan`, and `plan()`, the pure function producing it.

A plan names one device pool per colocated set (pools take consecutive device ranges in the order
listed), and per model its pool, device count, training/inference layout (p, t, d), generation
layout (pg, tg), and predicted seconds per stage and bytes per device. It also carries every other
placement's best result, ranked, so a user can see what the winner beat, and the `EngineLimits` it
was searched under. `plan_to_resources` reduces a plan to what the trainer needs to build its resource
pools and parallel configs.

A plan also says which schedule it runs (docs/planner.md): synchronous (`rollout_ahead: 0`, the paper's
stages one after another) or one step ahead (`rollout_ahead: 1`, ahead.py: generation on its own pool,
`rollout`, overlapping the other models' work). Either way it records the best plan of the other
schedule (`synchronous_seconds`, `ahead`) so `hybridflow plan --explain` can set them side by side,
and for each schedule whether it priced the actor's old-log-prob forward (`old_log_probs`: "actor" or
"free", dataflow.py; a plan file without the field loads as "actor", the forward such plans priced).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridflow.planner.ahead import FROZEN_POOLS, ROLLOUT_POOL, AheadResult, search_ahead, training_side
from hybridflow.planner.dataflow import OLD_LOG_PROBS, STAGES, Dataflow, with_old_log_probs
from hybridflow.planner.parallel import UNCONSTRAINED
from hybridflow.planner.search import PlacementResult, search, step_rest, strategy_name
from hybridflow.planner.specs import ClusterSpec, EngineLimits, GiB, WorkloadSpec, load_dict, save_dict


@dataclass
class ModelPlan:
    role: str
    model: str  # size label, e.g. "13B"
    pool: str
    n_devices: int
    p: int  # training / inference pipeline-parallel size
    t: int  # training / inference tensor-parallel size
    d: int  # training / inference data-parallel size
    pg: int  # generation pipeline size (3D-HybridEngine); = p for models that do not generate
    tg: int  # generation tensor size; = t for models that do not generate
    checkpoint: bool  # activation checkpointing in training
    offload: bool  # state parked in host memory between the model's stages
    waves: int  # generation rounds per replica (1 = the KV cache holds all its sequences)
    stage_seconds: dict[str, float]  # predicted busy time per stage
    switch_seconds: float  # actor train -> generate resharding (part of its generation time)
    persistent_gib: float  # per device, held all iteration
    transient_gib: float  # per device, extra peak while this model runs


@dataclass
class PoolPlan:
    name: str
    roles: list[str]
    n_devices: int
    first_device: int  # pools take consecutive device ranges, in plan order
    stage_seconds: dict[str, float]  # sum over the pool's models (they take turns)
    peak_gib: float  # per device: all persistent bytes + the largest transient peak


@dataclass
class Alternative:
    """The best result of one placement, for comparison."""

    strategy: str  # colocate, split, standalone, or custom
    placement: list[list[str]]
    allocation: list[int]
    iteration_seconds: float
    stage_seconds: dict[str, float]


SCHEDULES = ("auto", "sync", "ahead")  # auto: whichever predicts the shorter iteration


@dataclass
class RolloutPlan:
    """The one-step-ahead schedule's best plan (ahead.py): a rollout pool that only generates, placed
    after the training side's pools, and the predicted overlap."""

    n_devices: int
    first_device: int
    pg: int  # generation layout on the rollout pool
    tg: int
    waves: int
    generation_seconds: float  # on the rollout pool, no hybrid-engine switch
    training_side_seconds: float  # preparation + training of the other pools
    sync_seconds: float  # actor weights -> rollout pool, each iteration
    sync_bytes: float  # received per rollout device, each iteration
    iteration_seconds: float  # max(generation + sync, training side + sender_waits * sync)
    placement: list[list[str]]  # the training side's pools
    allocation: list[int]
    weight_gib: float  # per rollout device
    kv_gib: float
    # where the frozen models (reference, reward, cost) run; "training" for a plan file without the field
    frozen_pool: str = "training"
    frozen: list[str] = field(default_factory=list)  # those on the rollout pool ("rollout", "both")
    scoring_seconds: float = 0.0  # their forwards on the rollout pool, after generation ("both": its share)
    # frozen_pool "both" (ahead_both.py): the share of the rows the rollout pool's reference scores, and the
    # reference's forward over the whole batch on each side (0 for a plan file without the field)
    ref_rows_on_rollout: float = 0.0
    ref_rollout_seconds: float = 0.0
    ref_training_seconds: float = 0.0
    sender_waits: float = 1.0  # the share of the sync the training side waits for (1 in older plans)
    old_log_probs: str = "actor"  # "free": no actor forward for old log-probs priced (rollout_ahead=1)


@dataclass
class Plan:
    algorithm: str
    device: str
    num_devices: int
    devices_per_node: int
    workload: dict
    pools: list[PoolPlan]
    models: list[ModelPlan]
    stage_seconds: dict[str, float]  # per stage: max over pools
    iteration_seconds: float  # the stages + rest_seconds
    throughput_tokens_per_s: float  # (prompt + response tokens of the batch) / iteration time
    alternatives: list[Alternative] = field(default_factory=list)  # ranked, the winner first
    # EngineLimits fields the search ran under; {} (also a plan file without the field) = none
    engine_limits: dict = field(default_factory=dict)
    rollout_ahead: int = 0  # the schedule this plan runs: 0 synchronous, 1 one step ahead (`ahead`)
    ahead: RolloutPlan | None = None  # the best one-step-ahead plan (None: not searched or no fit)
    synchronous_seconds: float = 0.0  # the best synchronous plan's iteration (0: none fits)
    old_log_probs: str = "actor"  # the synchronous schedule's: "free" = no actor preparation forward priced
    # priced with a device profile measured on the machine (profile.py); False: the catalogue's datasheet entry
    device_measured: bool = False
    # the step's work no stage holds (simulate.step_rest_time: the stages' and the advantages' calls, the
    # driver's own work; plan.dataflow_rest), in iteration_seconds; 0 for a plan file without the field
    rest_seconds: float = 0.0

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(**self.engine_limits)

    @property
    def strategy(self) -> str:
        return strategy_name([pool.roles for pool in self.pools], [m.role for m in self.models])

    def model(self, role: str) -> ModelPlan:
        for m in self.models:
            if m.role == role:
                return m
        raise KeyError(f"plan has no model {role!r}; it has {[m.role for m in self.models]}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        data = dict(data)
        data["pools"] = [PoolPlan(**p) for p in data["pools"]]
        data["models"] = [ModelPlan(**m) for m in data["models"]]
        data["alternatives"] = [Alternative(**a) for a in data.get("alternatives", [])]
        if data.get("ahead") is not None:
            data["ahead"] = RolloutPlan(**data["ahead"])
        if data.get("ahead") is not None and data["ahead"].frozen_pool not in FROZEN_POOLS:
            raise ValueError(
                f"ahead.frozen_pool must be one of {FROZEN_POOLS}, got {data['ahead'].frozen_pool!r}"
            )
        if data.get("rollout_ahead", 0) not in (0, 1):
            raise ValueError(f"rollout_ahead must be 0 or 1, got {data['rollout_ahead']!r}")
        if data.get("rollout_ahead") == 1 and data.get("ahead") is None:
            raise ValueError("rollout_ahead: 1 needs the `ahead` section (the rollout pool)")
        sources = [data.get("old_log_probs", "actor")] + (
            [data["ahead"].old_log_probs] if data.get("ahead") else []
        )
        for source in sources:
            if source not in OLD_LOG_PROBS:
                raise ValueError(f"old_log_probs must be one of {OLD_LOG_PROBS}, got {source!r}")
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        """Write YAML (.yaml/.yml) or JSON (anything else)."""
        return save_dict(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        hint = f"no plan file at {path}; write one with `hybridflow plan --output {path}`"
        return cls.from_dict(load_dict(path, hint))


def _stage_dict(values) -> dict[str, float]:
    return {s: float(v) for s, v in zip(STAGES, values)}


def _pool_name(roles) -> str:
    return "+".join(roles)


def _pools_and_models(dataflow: Dataflow, best: PlacementResult) -> tuple[list[PoolPlan], list[ModelPlan]]:
    pools, models, first = [], [], 0
    order = {r: i for i, r in enumerate(dataflow.roles)}
    sets = sorted(zip(best.placement, best.allocation, best.choices), key=lambda x: order[x[0][0]])
    for roles, n, choice in sets:  # the actor's pool first
        name = _pool_name(roles)
        stage = [sum(o.stage_times[s] for o in choice) for s in range(len(STAGES))]
        peak = sum(o.persistent_bytes for o in choice) + max(o.transient_bytes for o in choice)
        pools.append(PoolPlan(name, list(roles), n, first, _stage_dict(stage), peak / GiB))
        first += n
        for o in choice:
            models.append(
                ModelPlan(
                    o.role, dataflow.model(o.role).spec.name, name, n, o.p, o.t, o.d, o.pg, o.tg,
                    o.checkpoint, o.offload, o.waves, _stage_dict(o.stage_times), o.switch_time,
                    o.persistent_bytes / GiB, o.transient_bytes / GiB,
                )
            )  # fmt: skip
    models.sort(key=lambda m: order[m.role])
    return pools, models


def _rollout_plan(ahead: AheadResult, rest: float) -> RolloutPlan:
    r, train = ahead.rollout, ahead.train
    return RolloutPlan(
        n_devices=r.n_devices, first_device=sum(train.allocation), pg=r.pg, tg=r.tg, waves=r.waves,
        generation_seconds=r.generation_seconds, training_side_seconds=ahead.training_side_seconds,
        sync_seconds=ahead.sync_seconds, sync_bytes=ahead.sync_bytes, iteration_seconds=ahead.iteration_time + rest,
        placement=[list(s) for s in train.placement], allocation=list(train.allocation),
        weight_gib=r.weight_bytes / GiB, kv_gib=r.kv_bytes / GiB, frozen_pool=ahead.frozen_pool,
        frozen=list(ahead.frozen), scoring_seconds=ahead.scoring_seconds, sender_waits=ahead.sender_waits,
        old_log_probs=ahead.old_log_probs, ref_rows_on_rollout=ahead.ref_rows_on_rollout,
        ref_rollout_seconds=ahead.ref_rollout_seconds, ref_training_seconds=ahead.ref_training_seconds,
    )  # fmt: skip


def dataflow_rest(
    dataflow: Dataflow, cluster: ClusterSpec, wl: WorkloadSpec, result: PlacementResult
) -> float:
    """The step's rest (search.step_rest) to groups as large as `result`'s largest pool. One step ahead the
    training side has no generation: the rollout pool's call is priced in its generation seconds
    (ahead.rollout_option), issued a step before and overlapping this one."""
    return step_rest(dataflow, cluster, wl, max(result.allocation, default=1))


def choose_schedule(schedule: str, sync_seconds: float | None, ahead_seconds: float | None) -> int:
    """rollout_ahead (0 or 1) for `schedule`: "auto" takes one step ahead only when it predicts a
    strictly shorter iteration (off-policy by one step is a cost the synchronous schedule does not pay)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "sync" or ahead_seconds is None:
        return 0
    if schedule == "ahead" or sync_seconds is None:
        return 1
    return int(ahead_seconds < sync_seconds * (1 - 1e-9))


def build_plan(
    dataflow: Dataflow,
    cluster: ClusterSpec,
    wl: WorkloadSpec,
    results: list[PlacementResult],
    limits: EngineLimits = UNCONSTRAINED,
    ahead: AheadResult | None = None,
    schedule: str = "sync",
) -> Plan:
    """Turn synchronous search results (ranked by their stages) and the best one-step-ahead result, both
    searched under `limits`, into a Plan running `schedule` (auto: the faster of the two). The results are
    ranked again with each one's rest: its calls go to its own groups (dataflow_rest)."""
    ranked = sorted(
        ((r, dataflow_rest(dataflow, cluster, wl, r)) for r in results),
        key=lambda p: p[0].iteration_time + p[1],
    )
    ahead_rest = 0.0
    if ahead:
        side = training_side(with_old_log_probs(dataflow, ahead.old_log_probs), ahead.frozen_pool)
        ahead_rest = dataflow_rest(side, cluster, wl, ahead.train)
    sync_best = ranked[0][0].iteration_time + ranked[0][1] if ranked else None
    rollout_ahead = choose_schedule(schedule, sync_best, ahead.iteration_time + ahead_rest if ahead else None)
    if not ranked and not rollout_ahead:
        within = "" if limits == UNCONSTRAINED else f" with layouts the engines run ({limits.describe()})"
        if schedule == "ahead":
            within += " one step ahead (the rollout pool needs one device of its own and the rest must fit)"
        raise ValueError(
            f"no placement of {dataflow.roles} fits on {cluster.num_devices} x {cluster.device.name}"
            f"{within}: add devices, use a device with more memory, or shrink the models / batch"
        )
    if schedule == "ahead" and ahead is None:
        raise ValueError(
            f"no one-step-ahead plan of {dataflow.roles} fits on {cluster.num_devices} x "
            f"{cluster.device.name} (a rollout pool of its own needs >= 2 devices and memory for the rest); "
            "plan the synchronous schedule (--schedule sync) or add devices"
        )
    if rollout_ahead:
        pools, models = _pools_and_models(side, ahead.train)
        stage = dict(_stage_dict(ahead.train.stage_times), generation=ahead.rollout.generation_seconds)
        rest, iteration = ahead_rest, ahead.iteration_time + ahead_rest
    else:
        (best, rest), iteration = ranked[0], sync_best
        pools, models = _pools_and_models(dataflow, best)
        stage = _stage_dict(best.stage_times)
    roles = list(dataflow.roles)
    alternatives = [
        Alternative(
            strategy_name([list(s) for s in r.placement], roles),
            [list(s) for s in r.placement],
            list(r.allocation),
            r.iteration_time + r_rest,
            _stage_dict(r.stage_times),
        )
        for r, r_rest in ranked
    ]
    tokens = wl.sequences * wl.seq_len
    return Plan(
        algorithm=dataflow.algorithm,
        device=cluster.device.name,
        num_devices=cluster.num_devices,
        devices_per_node=cluster.devices_per_node,
        workload={
            **asdict(wl),
            "role_micro_batches": [list(r) for r in wl.role_micro_batches],
        },  # as YAML reads it
        pools=pools,
        models=models,
        stage_seconds=stage,
        iteration_seconds=iteration,
        throughput_tokens_per_s=tokens / iteration,
        alternatives=alternatives,
        engine_limits=json.loads(json.dumps(asdict(limits))),  # as a plan file reads back: lists, not tuples
        rollout_ahead=rollout_ahead,
        ahead=_rollout_plan(ahead, ahead_rest) if ahead else None,
        synchronous_seconds=sync_best or 0.0,
        old_log_probs=dataflow.old_log_probs,
        device_measured=cluster.device.measured,
        rest_seconds=rest,
    )


def plan(
    dataflow: Dataflow,
    cluster: ClusterSpec,
    wl: WorkloadSpec | None = None,
    limits: EngineLimits = UNCONSTRAINED,
    schedule: str = "sync",
    frozen_pool: str = "auto",
    ahead_old_log_probs: str | None = None,
) -> Plan:
    """The auto-mapping planner: (dataflow, cluster, workload) -> the fastest predicted Plan whose
    layouts are all within the executing engines' `limits` (default: none, the paper's search).

    `schedule`: "sync" (the paper's), "ahead" (one step ahead, ahead.py) or "auto" (the faster);
    `frozen_pool`: one step ahead, where the frozen models run (ahead.py: "training", "rollout", "both" or
    "auto");
    `ahead_old_log_probs`: the one-step-ahead candidate's old-log-prob source where it differs from
    `dataflow.old_log_probs` (dataflow.old_log_prob_work with rollout_ahead=1; None: the same).
    The synchronous search always runs (the plan records its best for comparison)."""
    wl = wl or WorkloadSpec()
    choose_schedule(schedule, None, None)  # reject an unknown name before searching
    results = search(dataflow, cluster, wl, limits)
    ahead = None
    if schedule != "sync":
        ahead_df = with_old_log_probs(dataflow, ahead_old_log_probs or dataflow.old_log_probs)
        ahead = search_ahead(ahead_df, cluster, wl, limits, None, frozen_pool)
    return build_plan(dataflow, cluster, wl, results, limits, ahead, schedule)


@dataclass(frozen=True)
class ModelResources:
    """What the trainer needs to place one model."""

    pool: str
    n_devices: int
    pp: int
    tp: int
    dp: int
    pg: int  # generation pipeline size
    tg: int  # generation tensor size


@dataclass(frozen=True)
class Resources:
    """Pools (name -> devices, in order, consecutive ranges) and per-model layouts, keyed by role."""

    pools: dict[str, int]
    models: dict[str, ModelResources]
    rollout_ahead: int = 0  # 1: pools[ROLLOUT_POOL] generates one step ahead, models["rollout"] its layout

    def to_dict(self) -> dict:
        return {
            "pools": dict(self.pools),
            "models": {r: asdict(m) for r, m in self.models.items()},
            "rollout_ahead": self.rollout_ahead,
        }


def plan_to_resources(plan: Plan) -> Resources:
    """The small, pure description of a plan that the trainer consumes (roles as the planner names
    them: actor, critic, reference, reward, cost; one step ahead adds the `rollout` pool and model)."""
    pools = {p.name: p.n_devices for p in plan.pools}
    models = {m.role: ModelResources(m.pool, m.n_devices, m.p, m.t, m.d, m.pg, m.tg) for m in plan.models}
    if plan.rollout_ahead:
        r = plan.ahead
        pools[ROLLOUT_POOL] = r.n_devices
        models[ROLLOUT_POOL] = ModelResources(
            ROLLOUT_POOL, r.n_devices, r.pg, r.tg, r.n_devices // (r.pg * r.tg), r.pg, r.tg
        )
    return Resources(pools=pools, models=models, rollout_ahead=plan.rollout_ahead)
