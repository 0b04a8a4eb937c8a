"""Which resource pool each model's worker group runs on, and building those groups (docs/design.md §3).

A `Placement` names pools (name -> device count) and assigns each role to one. Roles on the same
pool are colocated: they share one process per device (create_colocated_groups) and take turns;
roles on different pools run in separate processes on disjoint devices.

Roles: "actor_rollout" (ActorRolloutRefWorker with actor + rollout), "ref", "critic",
"cost_critic", "reward" (reward model), "cost" (cost model), "rollout" (trainer.rollout_ahead=1: an
ActorRolloutRefWorker with only the rollout engine, on a pool of its own). A ref on the actor's pool
joins the actor's worker instance (one process, two engines), as verl's ActorRolloutRefWorker does.

From the config (`resources.placement`): "colocate" puts every role on one pool of all devices;
"split" puts actor + ref on one half and critic + reward (+ cost) on the other; "auto" runs the
planner and a path loads a plan file (`hybridflow plan --output plan.yaml`): auto_placement.py checks
the plan and `placement_from_plan` turns it into pools plus each role's parallel sizes, which `role_config` writes into the config
each worker group is built with (the trainer's own config keeps what the user wrote). With
trainer.rollout_ahead=1 a "rollout" pool is added: resources.rollout_devices of the devices under
colocate / split, the pools above sharing the rest (config/rollout_pool.py); the plan's `ahead` pool
and tg under auto / a plan file. Its workers generate rollout.tg-way (rollout/pool_tp.py); with
resources.frozen_pool rollout (auto under colocate / split, or a plan that says so) the frozen models
(ref, reward, cost) go on that pool too, the ref joining the rollout worker instance; with
resources.frozen_pool=both the ref also joins the actor's worker instance (groups["ref_training"]), and
the driver splits each batch's rows between the two (ref_split.RefSplit).
`write_placement` records what was built in run_dir/placement.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass, field

from hybridflow.agent.registry import pickled as pickled_agent_objects
from hybridflow.checkpoint import atomic_write_text
from hybridflow.config.roles import worker_config
from hybridflow.config.rollout_pool import (
    FROZEN_ROLES,
    frozen_on_rollout,
    ref_on_both_pools,
    rollout_devices,
    training_devices,
)
from hybridflow.config.validate import split_sizes
from hybridflow.controller import ResourcePool, WorkerGroup, create_colocated_groups, share_cpus
from hybridflow.errors import ConfigError
from hybridflow.planner import Plan
from hybridflow.planner.ahead import ROLLOUT_POOL
from hybridflow.trainers.auto_placement import (
    PLANNER_ROLE,
    PromptLengths,
    RoleParallel,
    check_plan,
    frozen_on_rollout_pool,
    load_plan,
    report_plan,
    trainer_roles,
    used_pools,
)
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

ROLES = ("actor_rollout", "ref", "critic", "cost_critic", "reward", "cost", "rollout")


@dataclass
class Placement:
    """pools: pool name -> devices; roles: role -> pool name (roles not listed go to `default_pool`);
    parallel: role -> RoleParallel (auto_placement.py) overriding the config's parallel sizes for
    that role (empty: the config's own); plan: the planner Plan this placement carries out, if any."""

    pools: dict[str, int]
    roles: dict[str, str] = field(default_factory=dict)
    default_pool: str = ""
    parallel: dict = field(default_factory=dict)
    plan: object = None
    ref_on_training: bool = False  # the ref on the rollout pool AND in the actor's workers (frozen_pool=both)

    def pool_of(self, role: str) -> str:
        pool = self.roles.get(role, self.default_pool or next(iter(self.pools)))
        if pool not in self.pools:
            raise ValueError(
                f"placement: role {role!r} is on pool {pool!r}, which is not one of {list(self.pools)}"
            )
        return pool

    @property
    def num_devices(self) -> int:
        return sum(self.pools.values())

    @classmethod
    def from_config(cls, cfg, prompts: PromptLengths = PromptLengths()) -> Placement:
        """prompts: the training prompts' lengths where loaded, for placement=auto."""
        placement = cls._training(cfg, prompts)
        if "rollout" in placement.pools:  # a one-step-ahead plan sized the rollout pool (auto_placement.py)
            return placement
        if rollout_devices(cfg):  # trainer.rollout_ahead=1: the rollout pool, beside the training pools
            pools = {**placement.pools, "rollout": rollout_devices(cfg)}
            default = placement.default_pool or next(iter(placement.pools))
            roles = {**placement.roles, "rollout": "rollout"}
            if frozen_on_rollout(cfg):  # resources.frozen_pool=rollout: they score on the rollout pool
                roles.update(dict.fromkeys(FROZEN_ROLES, "rollout"))
            both = ref_on_both_pools(cfg)
            return cls(pools, roles, default, placement.parallel, placement.plan, ref_on_training=both)
        return placement

    @classmethod
    def _training(cls, cfg, prompts: PromptLengths) -> Placement:
        n, kind = training_devices(cfg), cfg.resources.placement
        if kind == "colocate":
            return cls({"global": n})
        if kind == "split":
            if n < 2:
                raise ValueError(
                    "resources.placement=split needs at least 2 devices (actor+ref | critic+reward)"
                )
            actor, critic = split_sizes(n)  # the sizes resolve_config derived dp from
            return cls(
                {"actor": actor, "critic": critic},
                {"actor_rollout": "actor", "ref": "actor", "critic": "critic", "cost_critic": "critic",
                 "reward": "critic", "cost": "critic"},
            )  # fmt: skip
        return placement_for_config(cfg, prompts=prompts)  # "auto" or a plan file


def placement_from_plan(p: Plan, cfg, source: str = "plan"):
    """The Placement that carries out `p` for `cfg` (raises ConfigError listing every problem)."""
    errors = check_plan(p, cfg, source)
    if errors:
        raise ConfigError([f"resources.placement: {e}" for e in errors])
    used = used_pools(p, cfg)
    pools = {pool.name: pool.n_devices for pool in p.pools if pool.name in used}
    roles, parallel = {}, {}
    for role in trainer_roles(cfg):
        if PLANNER_ROLE[role] in frozen_on_rollout_pool(p):  # scores on the rollout pool, data parallel
            roles[role], parallel[role] = ROLLOUT_POOL, RoleParallel(1, 1, p.ahead.n_devices)
            continue
        m = p.model(PLANNER_ROLE[role])
        roles[role] = m.pool
        parallel[role] = RoleParallel(m.p, m.t, m.d, m.pg, m.tg, m.checkpoint, m.offload)
    if p.rollout_ahead:  # the one-step-ahead rollout group's own pool, after the training side's
        r = p.ahead
        pools[ROLLOUT_POOL], roles[ROLLOUT_POOL] = r.n_devices, ROLLOUT_POOL
        parallel[ROLLOUT_POOL] = RoleParallel(r.pg, r.tg, r.n_devices // (r.pg * r.tg), r.pg, r.tg)
    both = bool(p.rollout_ahead) and p.ahead.frozen_pool == "both" and "ref" in roles
    return Placement(pools, roles, parallel=parallel, plan=p, ref_on_training=both)


def placement_for_config(cfg, stream=None, prompts: PromptLengths = PromptLengths()):
    """resources.placement = auto | plan file -> Placement; prints the plan and saves it to
    run_dir/plan.yaml so the run records the layout it ran with. prompts: the training prompts' lengths
    where loaded, which `auto` prices passes at (auto_placement.py)."""
    p, source = load_plan(cfg, prompts)
    placement = placement_from_plan(p, cfg, source)
    report_plan(p, placement, cfg, source, stream or sys.stdout)
    os.makedirs(cfg.run_dir, exist_ok=True)
    if os.path.abspath(source) != os.path.abspath(os.path.join(cfg.run_dir, "plan.yaml")):
        p.save(os.path.join(cfg.run_dir, "plan.yaml"))
    return placement


def role_config(cfg, placement: Placement, role: str):
    """The config `role`'s worker is built with: `cfg`, with the placement's parallel sizes (if any)
    written into the sections the workers read (actor.parallel + rollout.pg/tg, ref.parallel,
    critic.parallel, reward.parallel; the cost model reads reward.parallel too, so it gets its own copy)."""
    if not placement.parallel:
        return cfg
    cfg = copy.deepcopy(cfg)
    sections = {"actor_rollout": cfg.actor, "ref": cfg.ref, "critic": cfg.critic, "reward": cfg.reward}
    for r, section in sections.items():
        if r in placement.parallel:
            _set_parallel(section, placement.parallel[r])
    if "ref" not in placement.parallel and "actor_rollout" in placement.parallel:
        # no reference in the plan: the actor's worker still reads ref.parallel (builds no reference)
        _set_parallel(cfg.ref, placement.parallel["actor_rollout"])
    if role == "cost" and "cost" in placement.parallel:
        _set_parallel(cfg.reward, placement.parallel["cost"])
    # generation layout: the rollout pool's own (a one-step-ahead plan), else the actor's
    gen = placement.parallel.get("rollout" if role == "rollout" else "actor_rollout")
    if gen is not None:
        cfg.rollout.pg, cfg.rollout.tg = gen.pg, gen.tg
    return cfg


def _set_parallel(section, sizes) -> None:
    p = section.parallel
    p.pp, p.tp, p.dp = sizes.pp, sizes.tp, sizes.dp
    # the plan's memory choices (auto_placement.RoleParallel); a setting the user turned on stays on
    if getattr(sizes, "checkpoint", False) and hasattr(section, "gradient_checkpointing"):
        section.gradient_checkpointing = True
    if getattr(sizes, "offload", False) and hasattr(section, "offload"):
        section.offload = True


def rollout_pool_config(cfg, devices: int, with_ref: bool = False):
    """The config of the rollout pool's workers (`devices` of them): the actor's parallel sizes (read when
    the worker is built, though it trains nothing) become plain data parallel over the pool, and the
    reference's too unless it runs there (`with_ref`, resources.frozen_pool=rollout: its own sizes, which
    validation or the plan fitted to the pool); its generation TP groups come from rollout.tg
    (rollout/pool_tp.py)."""
    cfg = copy.deepcopy(cfg)
    for p in (cfg.actor.parallel,) if with_ref else (cfg.actor.parallel, cfg.ref.parallel):
        p.tp, p.pp, p.dp = 1, 1, devices
    return cfg


def _use_gpu(cfg) -> bool | None:
    return {"cpu": False, "cuda": True}.get(cfg.resources.device)


def build_worker_groups(
    cfg, placement: Placement, roles: dict[str, dict]
) -> tuple[dict[str, WorkerGroup], list]:
    """Create pools and worker groups for `roles` (role -> extra init kwargs), then init every model.

    Returns (groups by role, pools). groups["ref"] is groups["actor_rollout"] (or groups["rollout"]) when
    they share a pool: the reference joins that ActorRolloutRefWorker instance; with LoRA it is always
    groups["actor_rollout"], whose actor computes it with the adapters off. With
    placement.ref_on_training a second reference joins the actor's instance: groups["ref_training"].
    """
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"unknown roles {unknown}; known: {ROLES}")
    by_pool: dict[str, list[str]] = {}
    for role in roles:
        by_pool.setdefault(placement.pool_of(role), []).append(role)
    ref_pool = placement.pool_of("ref") if "ref" in roles else None
    # the ActorRolloutRefWorker (actor's or rollout pool's) the reference joins, if one is on its pool
    host = next(
        (r for r in ("actor_rollout", "rollout") if r in roles and placement.pool_of(r) == ref_pool), None
    )
    pools, groups = [], {}
    try:
        for name in by_pool:
            pools.append(ResourcePool(placement.pools[name], name=name, use_gpu=_use_gpu(cfg)))
        share_cpus(pools)  # disjoint pools run at once: on CPU their ranks split the cores
        for pool, (name, pool_roles) in zip(pools, by_pool.items()):
            specs = {}
            for role in pool_roles:
                if role == "ref" and host:
                    continue  # joins the host's worker instance below
                with_ref = role == host
                role_cfg = role_config(cfg, placement, role)
                if role == "rollout":
                    role_cfg = rollout_pool_config(role_cfg, placement.pools[name], with_ref)
                if role == "actor_rollout" and placement.ref_on_training and "ref" in roles:
                    # the training pool's reference: the actor's parallel sizes fit this pool (cfg.ref's
                    # were fitted to the rollout pool, where the other reference runs)
                    role_cfg, with_ref = copy.deepcopy(role_cfg), True
                    _set_parallel(role_cfg.ref, role_cfg.actor.parallel)
                specs[role] = _spec(role_cfg, role, roles[role], with_ref)
            made = create_colocated_groups(pool, specs, group_name=f"{name}:{'+'.join(specs)}")
            groups.update(made)
        if host:
            groups["ref"] = groups[host]
        if cfg.model.lora.enabled and "actor_rollout" in groups:
            groups["ref"] = groups["actor_rollout"]  # the actor with its adapters off (workers/actor.py)
        if placement.ref_on_training and "ref" in roles:
            groups["ref_training"] = groups["actor_rollout"]
        for role in ROLES:  # actor first: colocated models are built in a fixed order on every rank
            if role in groups and not (role == "ref" and host):
                groups[role].init_model()
    except BaseException:
        shutdown(groups, pools)
        raise
    return groups, pools


def _spec(tree, role: str, kwargs: dict, with_ref: bool) -> tuple[type, dict]:
    """The worker class of `role` and its init kwargs: its part of the config tree (config/roles.py) only."""
    cfg = worker_config(tree, role)
    if role in ("rollout", "actor_rollout"):  # the Python API's tools reach the agent loop by value
        kwargs = {**kwargs, "agent_objects": pickled_agent_objects(tree.rollout.multi_turn)}
    if role == "rollout":  # generation (+ the reference), on its own pool (rollout_pool_config), no actor
        return ActorRolloutRefWorker, {
            "config": cfg,
            "roles": ("rollout", "ref") if with_ref else ("rollout",),
            **kwargs,
        }
    if role == "actor_rollout":
        worker_roles = ("actor", "rollout", "ref") if with_ref else ("actor", "rollout")
        return ActorRolloutRefWorker, {"config": cfg, "roles": worker_roles, **kwargs}
    if role == "ref":
        return ActorRolloutRefWorker, {"config": cfg, "roles": ("ref",), **kwargs}
    if role == "critic":
        return CriticWorker, {"config": cfg, **kwargs}
    if role == "cost_critic":
        return CriticWorker, {"config": cfg, "name": "cost_critic", "values_key": "cost_values",
                              "returns_key": "cost_returns", **kwargs}  # fmt: skip
    if role == "reward":
        return RewardModelWorker, {"config": cfg, "model_path": tree.model.reward_model_path, **kwargs}
    return RewardModelWorker, {
        "config": cfg,
        "model_path": tree.model.cost_model_path,
        "score_key": "cost_scores",
        **kwargs,
    }


_LAYOUTS = {"actor_rollout": ("train", "rollout"), "rollout": ("rollout",), "ref": ("ref",)}  # recorded


def describe(placement: Placement, groups: dict[str, WorkerGroup]) -> dict:
    """What was built, as run_dir/placement.json records it: each pool's devices and each role's pool,
    processes and the layouts it runs (train: dp x tp of the actor's training; rollout: generation
    replicas x tg)."""
    roles = {}
    for role, group in groups.items():
        entry = {"pool": placement.pool_of(role), "world_size": group.world_size}
        for name in _LAYOUTS.get(role, ()):
            lay = group.layouts(name)[0]
            entry[name] = {"dp": lay.dp_size, "tp": lay.tp_size}
        roles[role] = entry
    plan = placement.plan
    schedule = None if plan is None else {"rollout_ahead": plan.rollout_ahead}
    return {"pools": dict(placement.pools), "roles": roles, "plan": schedule}


def write_placement(run_dir, placement: Placement, groups: dict[str, WorkerGroup]) -> None:
    """run_dir/placement.json: describe(placement, groups), so a run's record says what it ran on."""
    os.makedirs(run_dir, exist_ok=True)
    text = json.dumps(describe(placement, groups), indent=1, sort_keys=True)
    atomic_write_text(os.path.join(run_dir, "placement.json"), text)


def shutdown(groups: dict[str, WorkerGroup], pools: list) -> None:
    """Kill every group's processes, then release the pools."""
    for g in groups.values():
        g.shutdown()  # colocated groups share processes; a second shutdown is a no-op
    for p in pools:
        p.shutdown()
