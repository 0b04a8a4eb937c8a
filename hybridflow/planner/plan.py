"""The planner's output: a printable, serialisable `Plan`, and `plan()`, the pure function producing it.

A plan names one device pool per colocated set (pools take consecutive device ranges in the order
listed), and per model its pool, device count, training/inference layout (p, t, d), generation
layout (pg, tg), and predicted seconds per stage and bytes per device. It also carries every other
placement's best result, ranked, so a user can see what the winner beat, and the `EngineLimits` it
was searched under. `plan_to_resources` reduces a plan to what the trainer needs to build its resource
pools and parallel configs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridflow.planner.dataflow import STAGES, Dataflow
from hybridflow.planner.parallel import UNCONSTRAINED
from hybridflow.planner.search import PlacementResult, search, strategy_name
from hybridflow.planner.specs import ClusterSpec, EngineLimits, GiB, WorkloadSpec


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
    iteration_seconds: float
    throughput_tokens_per_s: float  # (prompt + response tokens of the batch) / iteration time
    alternatives: list[Alternative] = field(default_factory=list)  # ranked, the winner first
    # EngineLimits fields the search ran under; {} (plans written before limits existed) = none
    engine_limits: dict = field(default_factory=dict)

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
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        """Write YAML (.yaml/.yml) or JSON (anything else)."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        else:
            path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"no plan file at {path}; write one with `hybridflow plan --output {path}`"
            )
        if path.suffix in (".yaml", ".yml"):
            import yaml

            return cls.from_dict(yaml.safe_load(path.read_text()))
        return cls.from_dict(json.loads(path.read_text()))


def _stage_dict(values) -> dict[str, float]:
    return {s: float(v) for s, v in zip(STAGES, values)}


def _pool_name(roles) -> str:
    return "+".join(roles)


def build_plan(
    dataflow: Dataflow,
    cluster: ClusterSpec,
    wl: WorkloadSpec,
    results: list[PlacementResult],
    limits: EngineLimits = UNCONSTRAINED,
) -> Plan:
    """Turn ranked search results (best first), searched under `limits`, into a Plan."""
    if not results:
        within = "" if limits == UNCONSTRAINED else f" with layouts the engines run ({limits.describe()})"
        raise ValueError(
            f"no placement of {dataflow.roles} fits on {cluster.num_devices} x {cluster.device.name}"
            f"{within}: add devices, use a device with more memory, or shrink the models / batch"
        )
    best = results[0]
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
    roles = list(dataflow.roles)
    alternatives = [
        Alternative(
            strategy_name([list(s) for s in r.placement], roles),
            [list(s) for s in r.placement],
            list(r.allocation),
            r.iteration_time,
            _stage_dict(r.stage_times),
        )
        for r in results
    ]
    tokens = wl.sequences * wl.seq_len
    return Plan(
        algorithm=dataflow.algorithm,
        device=cluster.device.name,
        num_devices=cluster.num_devices,
        devices_per_node=cluster.devices_per_node,
        workload=asdict(wl),
        pools=pools,
        models=models,
        stage_seconds=_stage_dict(best.stage_times),
        iteration_seconds=best.iteration_time,
        throughput_tokens_per_s=tokens / best.iteration_time,
        alternatives=alternatives,
        engine_limits=asdict(limits),
    )


def plan(
    dataflow: Dataflow,
    cluster: ClusterSpec,
    wl: WorkloadSpec | None = None,
    limits: EngineLimits = UNCONSTRAINED,
) -> Plan:
    """The auto-mapping planner: (dataflow, cluster, workload) -> the fastest predicted Plan whose
    layouts are all within the executing engines' `limits` (default: none, the paper's search)."""
    wl = wl or WorkloadSpec()
    return build_plan(dataflow, cluster, wl, search(dataflow, cluster, wl, limits), limits)


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

    def to_dict(self) -> dict:
        return {"pools": dict(self.pools), "models": {r: asdict(m) for r, m in self.models.items()}}


def plan_to_resources(plan: Plan) -> Resources:
    """The small, pure description of a plan that the trainer consumes (roles as the planner names
    them: actor, critic, reference, reward, cost)."""
    return Resources(
        pools={p.name: p.n_devices for p in plan.pools},
        models={m.role: ModelResources(m.pool, m.n_devices, m.p, m.t, m.d, m.pg, m.tg) for m in plan.models},
    )
