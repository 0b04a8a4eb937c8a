"""Carrying out an auto-mapping plan (docs/design.md §5, §7): config -> planner inputs -> Plan -> Placement.

The planner (hybridflow/planner) is a pure function of (dataflow, cluster, workload); this module
builds those three from the config, runs it for `resources.placement: auto` or loads a plan file
(`hybridflow plan --output plan.yaml`), checks that the plan fits the config and what the engines can
run, and says which pools and per-role parallel sizes carry it out (placement.py's `placement_from_plan`
turns that into a `Placement`: one pool per colocated set plus each role's parallel sizes).

    dataflow   the configured algorithm's models, shapes read from their HF config.json (ModelSpec), the
               actor's old-log-prob forward priced only where the trainer runs one (trainers/rl.py
               old_log_prob_source on this config, per schedule: `planner_old_log_probs`)
    cluster    resources.n_gpus_per_node x nnodes devices: resources.planner_profile's measured entry
               (`hybridflow calibrate --out FILE`) where set, else the catalogue's "cpu" entry on CPU, on
               GPU the entry matching the CUDA device name (asked of a child process, not the driver)
    workload   data.train_batch_size prompts x rollout.n samples, max prompt / response lengths,
               actor epochs, mini-batches and micro-batch sizes

Names: the planner says actor / critic / reference / reward / cost; the trainer's roles are
actor_rollout / ref / critic / cost_critic / reward / cost. The planner folds Safe-RLHF's cost critic
into the critic (as the paper counts models), so cost_critic goes where the critic goes, with its
layout. Plan models the config does not use (a reward model when the reward is a rule, a reference
when no KL term needs one) are skipped, and a pool left with no model is not started.

Departures: the training engine runs pipeline stages with t = 1 only, generates with pg = 1 and shards
whole heads, KV heads and MLP columns, so `auto` plans under planner/specs.py's `ENGINE_LIMITS` (the
paper's auto_parallel allows any p, t, pg and replicated KV heads), as `hybridflow plan` does by default,
narrowed to p = 1 for a role whose stages the config could not run (`config_limits`). A plan file may
come from `hybridflow plan --engines any`: one with a layout outside those, or a t that does not divide
the heads, is refused with what to change. Generation layouts (pg, tg) are copied to rollout.pg / rollout.tg (the 3D-HybridEngine runs them,
docs/hybrid_engine.md); a model the plan checkpoints or offloads gets gradient_checkpointing / offload
turned on (a setting the user turned on stays on).

Schedule: `auto` plans the schedule the config asks for (`trainer.rollout_ahead`: 0 synchronous, 1 one
step ahead with the rollout pool's size chosen by the planner) and says when the other one is predicted
faster; a plan file's `rollout_ahead` must match the config's (switching to off-policy training is the
user's call, not a placement's). A one-step-ahead plan adds the pool `rollout` (role "rollout", its
generation layout in `parallel["rollout"]`) for the trainer's rollout worker group; the frozen models it
lists (`ahead.frozen`, planned with resources.frozen_pool=rollout) go on that pool, data parallel over it;
a plan with `ahead.frozen_pool: both` also puts the reference in the actor's workers (Placement.ref_on_training,
as resources.frozen_pool=both does under colocate / split), the driver splitting each batch's rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import NamedTuple

from hybridflow.config import ConfigError
from hybridflow.config.algorithms import ALGORITHM_SPECS, algorithm_spec
from hybridflow.planner import (
    ClusterSpec,
    Dataflow,
    ModelSpec,
    Plan,
    WorkloadSpec,
    build_dataflow,
    plan,
)
from hybridflow.planner.ahead import ROLLOUT_POOL, search_ahead
from hybridflow.planner.dataflow import with_old_log_probs
from hybridflow.planner.plan import build_plan
from hybridflow.planner.profile import DeviceProfile
from hybridflow.planner.search import search
from hybridflow.planner.specs import (
    DEVICES,
    ENGINE_LIMITS,
    PIPELINE_ROLES,
    DeviceSpec,
    EngineLimits,
    get_device,
)
from hybridflow.trainers.plan_schedule import (
    REPLAN_FLAGS,
    check_schedule,
    config_rollout_ahead,
    planner_old_log_probs,
    report_old_log_probs,
    report_schedule,
)
from hybridflow.workers.common import computes_in_fp32

# trainer role -> planner role
PLANNER_ROLE = {
    "actor_rollout": "actor",
    "ref": "reference",
    "critic": "critic",
    "cost_critic": "critic",
    "reward": "reward",
    "cost": "cost",
}


@dataclass(frozen=True)
class RoleParallel:
    """One trainer role's layout from a plan: training/inference (pp, tp, dp), generation (pg, tg)."""

    pp: int
    tp: int
    dp: int
    pg: int = 1
    tg: int = 1
    checkpoint: bool = False  # the plan's activation checkpointing for this model
    offload: bool = False  # the plan parks this model's state in host memory between its stages


# ---- config -> planner inputs ----------------------------------------------------------------------
def trainer_roles(cfg) -> tuple[str, ...]:
    """The worker roles the configured online-RL trainer starts: its spec's (config/algorithms.py)."""
    planner_algorithm(cfg)  # raises for an algorithm the planner cannot place
    return algorithm_spec(cfg).roles(cfg)


def planner_algorithm(cfg) -> str:
    """The planner's dataflow for the configured algorithm (the spec says; RLOO and REINFORCE++ have
    GRPO's models and stages), or a ConfigError for one the planner cannot place."""
    spec = ALGORITHM_SPECS.get(cfg.algorithm.name)
    if spec is None or not spec.planner:
        planned = sorted(n for n, s in ALGORITHM_SPECS.items() if s.planner)
        raise ConfigError(
            [
                f"resources.placement={cfg.resources.placement!r}: the planner has no dataflow for "
                f"algorithm {cfg.algorithm.name!r} (it plans {planned}); "
                "use resources.placement=colocate or split"
            ]
        )
    return spec.planner


def _model_dirs(cfg) -> dict[str, str]:
    m = cfg.model
    return {
        "actor": m.path,
        "reference": m.path,
        "critic": m.critic_path or m.path,
        "reward": m.reward_model_path,
        "cost": m.cost_model_path,
    }


def build_planner_dataflow(cfg, rollout_ahead: int | None = None) -> Dataflow:
    """The configured algorithm's dataflow with only the models the trainer runs, each model's shape
    read from its directory's config.json, and the actor's old-log-prob forward where the trainer runs
    one with trainer.rollout_ahead = `rollout_ahead` (None: the config's)."""
    needed = {PLANNER_ROLE[r] for r in trainer_roles(cfg)}
    dirs = _model_dirs(cfg)
    specs = {role: ModelSpec.from_hf_config(dirs[role]) for role in needed}
    df = build_dataflow(
        planner_algorithm(cfg),
        specs["actor"],
        reward_model="reward" in needed,
        samples_per_prompt=cfg.rollout.n,
        old_log_probs=planner_old_log_probs(cfg, rollout_ahead),
    )
    models = tuple(replace(m, spec=specs[m.role]) for m in df.models if m.role in needed)
    return Dataflow(df.algorithm, models, df.old_log_probs)


def _micro_batch_rows(section, seq_len: int) -> int:
    """Rows a micro-batch of `section` holds: its max_tokens_per_micro_batch over full-length rows where set."""
    tokens = getattr(section, "max_tokens_per_micro_batch", 0)
    return max(1, tokens // seq_len) if tokens else section.micro_batch_size_per_device


def _packing(cfg) -> tuple[bool, bool]:
    """(padding removal, shared prompts) of the training-side forwards (model.remove_padding,
    model.share_prompt), resolved for the actor's model type as the engines resolve them."""
    from hybridflow.engines.packing import resolve_remove_padding, resolve_share_prompt
    from hybridflow.models.files import model_type

    kind = model_type(cfg.model.path) or ""
    try:
        packs = resolve_remove_padding(cfg.model.remove_padding, kind)
        return packs, resolve_share_prompt(cfg.model.share_prompt, packs)
    except ValueError:  # a contradiction the engines refuse in one line when they start
        return False, False


class PromptLengths(NamedTuple):
    """The training prompts' token counts where the dataset is loaded (0: unknown): passes that pack real
    tokens compute the mean, padded ones the longest (a batch's prompts are left-padded to its longest);
    data.max_prompt_length bounds memory."""

    mean: float = 0.0
    longest: int = 0

    @classmethod
    def of(cls, dataset) -> PromptLengths:
        """A PromptDataset's (data/prompts.py)."""
        return cls(dataset.mean_length(), dataset.longest_length())


def build_planner_workload(cfg, prompts: PromptLengths = PromptLengths()) -> WorkloadSpec:
    """The run's workload, its passes priced at the training prompts' lengths (`prompts`)."""
    d, act = cfg.data, cfg.actor
    seq_len = d.max_prompt_length + cfg.rollout.response_length
    rows = {s: _micro_batch_rows(getattr(cfg, s), seq_len) for s in ("actor", "critic", "ref", "reward")}
    packs, shares = _packing(cfg)
    return WorkloadSpec(
        prompts=d.train_batch_size,
        samples_per_prompt=cfg.rollout.n,
        prompt_len=d.max_prompt_length,
        response_len=cfg.rollout.response_length,
        ppo_epochs=act.ppo_epochs,
        mini_batches=act.num_mini_batches,
        micro_batch_size=rows["actor"],
        inference_micro_batch_size=rows["ref"],
        # each worker's passes run at its own section's size (workers/common.py engine_config)
        role_micro_batches=(
            ("actor", rows["actor"], rows["actor"]),
            ("critic", rows["critic"], rows["critic"]),
            ("reference", rows["ref"], rows["ref"]),
            ("reward", rows["reward"], rows["reward"]),
            ("cost", rows["reward"], rows["reward"]),
        ),
        shared_prompts=cfg.rollout.n > 1 and shares,
        mean_prompt_len=min(prompts.mean, d.max_prompt_length) if packs else 0.0,
        longest_prompt_len=min(prompts.longest, d.max_prompt_length),
    )


def detect_device(cfg) -> str:
    """The catalogue entry of this run's devices: "cpu" on CPU ("cpu-bf16" when model.dtype computes in bf16
    there), else the GPU this machine has, named by a child process (resource_pool.gpu_info: no CUDA
    context in the driver)."""
    from hybridflow.controller import resource_pool

    kind = cfg.resources.device
    cpu = "cpu" if computes_in_fp32(cfg.model.dtype, "cpu") else "cpu-bf16"
    if kind == "cpu" or (kind == "auto" and not resource_pool.uses_cuda(kind)):
        return cpu
    gpu = resource_pool.gpu_info()
    if gpu is None:
        raise ConfigError(
            [
                f"resources.placement=auto with resources.device={kind}, but this machine shows no GPU to "
                "name; write a plan for your GPUs (`hybridflow plan --gpu a100-80 --gpus N --output plan.yaml`) "
                "and set resources.placement=plan.yaml"
            ]
        )
    return device_entry(*gpu)


def device_entry(name: str, memory_gib: float) -> str:
    """Map a CUDA device name (e.g. "NVIDIA A100-SXM4-80GB") to a planner catalogue entry."""
    upper = name.upper()
    for key in ("H200", "H100"):
        if key in upper:
            return key.lower()
    if "A100" in upper:
        return "a100-80" if memory_gib > 48 else "a100-40"
    raise ConfigError(
        [
            f"resources.placement=auto: the planner's device catalogue {sorted(DEVICES)} has no entry for "
            f"{name!r}; write a plan with the nearest entry (`hybridflow plan --gpu ENTRY --output plan.yaml`) "
            "and set resources.placement=plan.yaml"
        ]
    )


def planner_device(cfg) -> DeviceSpec:
    """The device the planner prices this run's work on: resources.planner_profile's measured entry for
    the compute dtype, else the catalogue's entry (detect_device)."""
    path = cfg.resources.planner_profile
    if not path:
        return get_device(detect_device(cfg))
    try:
        profile = DeviceProfile.load(path)
        kind = "cpu" if detect_device(cfg).startswith("cpu") else "cuda"
        dtype = "float32" if computes_in_fp32(cfg.model.dtype, kind) else "bfloat16"
        return profile.device(dtype)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError([f"resources.planner_profile: {e}"]) from e


def build_planner_cluster(cfg) -> ClusterSpec:
    r = cfg.resources
    return ClusterSpec.build(planner_device(cfg), r.num_devices, r.n_gpus_per_node)


# the config section whose parallel.pp each planner role's pipeline is (the cost model: reward's)
_PIPELINE_SECTION = {
    "actor": "actor",
    "critic": "critic",
    "reference": "ref",
    "reward": "reward",
    "cost": "reward",
}


def config_limits(cfg) -> EngineLimits:
    """ENGINE_LIMITS with no pipeline for the roles whose stages this config could not run (LoRA, vLLM,
    a tied or non-Llama model, ...: config/pipeline_roles.py), so auto plans and accepts only what runs."""
    from dataclasses import replace

    from hybridflow.config.pipeline_roles import pipeline_blockers

    blocked = {s: bool(pipeline_blockers(cfg, s)) for s in set(_PIPELINE_SECTION.values())}
    limits = dict(ENGINE_LIMITS.pipeline_max_tp)  # a role not named runs stages with any t
    for role in PIPELINE_ROLES:
        if blocked[_PIPELINE_SECTION[role]]:
            limits[role] = 0
    return replace(ENGINE_LIMITS, pipeline_max_tp=tuple(limits.items()))


def plan_for_config(cfg, prompts: PromptLengths = PromptLengths()) -> Plan:
    """Run the planner on the config's dataflow, cluster and workload, within the built-in engines'
    limits (so `check_plan` accepts every layout it returns), for the schedule the config runs. Where
    the build has trainer.rollout_ahead the other schedule is searched too, for comparison; each
    schedule prices the old-log-prob forward as the trainer would run it under that schedule.
    prompts: the training prompts' lengths, where the caller has loaded them."""
    ahead, limits = config_rollout_ahead(cfg), config_limits(cfg)
    try:
        df = build_planner_dataflow(cfg, None if ahead is None else 0)
        cluster, wl = build_planner_cluster(cfg), build_planner_workload(cfg, prompts)
        if ahead is None:
            return plan(df, cluster, wl, limits=limits)
        results = search(df, cluster, wl, limits)
        fixed = getattr(cfg.resources, "rollout_devices", 0) or None  # the user's split, if set
        frozen_pool = getattr(cfg.resources, "frozen_pool", "training")  # auto: the faster place
        ahead_df = with_old_log_probs(df, planner_old_log_probs(cfg, 1))
        best_ahead = search_ahead(ahead_df, cluster, wl, limits, fixed, frozen_pool)
        schedule = "ahead" if ahead else "sync"
        return build_plan(df, cluster, wl, results, limits, best_ahead, schedule)
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError) as e:  # no placement fits, a model dir without config.json
        raise ConfigError([f"resources.placement=auto: {e}"]) from e


# ---- plan -> placement ---------------------------------------------------------------------------------
def load_plan(cfg, prompts: PromptLengths = PromptLengths()) -> tuple[Plan, str]:
    """(plan, where it came from) for resources.placement = auto or a plan file."""
    source = cfg.resources.placement
    if source == "auto":
        return plan_for_config(cfg, prompts), "auto"
    if not os.path.isfile(source):
        raise FileNotFoundError(
            f"resources.placement: no plan file at {source!r}; write one with "
            f"`hybridflow plan ... --output {source}`, or use colocate / split / auto"
        )
    try:
        return Plan.load(source), source
    except (KeyError, TypeError, ValueError) as e:
        msg = f"resources.placement: {source!r} is not a plan written by `hybridflow plan` ({e})"
        raise ConfigError([msg]) from e


def check_plan(p: Plan, cfg, source: str) -> list[str]:
    """Everything that stops `p` running under `cfg`, each message saying what to change."""
    replan = f"re-plan for this config (`hybridflow plan --algorithm {planner_algorithm(cfg)}`)"
    errors = []
    have = {m.role for m in p.models} | frozen_on_rollout_pool(p)
    missing = sorted({PLANNER_ROLE[r] for r in trainer_roles(cfg)} - have)
    if missing:
        errors.append(
            f"plan {source!r} (algorithm {p.algorithm}) has no model {missing} that {cfg.algorithm.name} "
            f"needs with this config; {replan} or use resources.placement=auto"
        )
    errors += check_schedule(p, cfg, source)
    used = used_pools(p, cfg)
    need = sum(pool.n_devices for pool in p.pools if pool.name in used)
    sizes = ", ".join(f"{pool.name}:{pool.n_devices}" for pool in p.pools if pool.name in used)
    if p.rollout_ahead and p.ahead is not None:
        need += p.ahead.n_devices
        sizes += f", {ROLLOUT_POOL}:{p.ahead.n_devices}"
    n = cfg.resources.num_devices
    if need > n:
        errors.append(
            f"plan {source!r} needs {need} devices ({sizes}) but resources.n_gpus_per_node * nnodes = {n}; "
            f"raise them or re-plan with --gpus {n}"
        )
    dirs, limits = _model_dirs(cfg), config_limits(cfg)
    pool_sizes = {pool.name: pool.n_devices for pool in p.pools}
    for m in p.models:
        if m.role not in {PLANNER_ROLE[r] for r in trainer_roles(cfg)}:
            continue
        where = f"plan {source!r}: {m.role} (p={m.p}, t={m.t}, d={m.d})"
        if pool_sizes.get(m.pool) != m.n_devices:
            errors.append(
                f"{where}: its pool {m.pool!r} has {pool_sizes.get(m.pool, 'no')} devices, not its "
                f"{m.n_devices} (colocated models span their whole pool); fix the plan"
            )
        if m.p * m.t * m.d != m.n_devices:
            errors.append(
                f"{where}: p*t*d = {m.p * m.t * m.d} is not its {m.n_devices} devices; fix the plan"
            )
        errors += _layout_errors(where, m, limits)
        if m.t > 1 and ENGINE_LIMITS.tp_shards_whole_heads and os.path.isdir(dirs[m.role]):
            spec = ModelSpec.from_hf_config(dirs[m.role])
            bad = {k: v for k, v in (("heads", spec.num_heads), ("kv_heads", spec.num_kv_heads),
                                     ("ffn_hidden", spec.ffn_hidden)) if v % m.t}  # fmt: skip
            if bad:
                errors.append(
                    f"{where}: the engine shards whole heads and MLP columns, but t={m.t} does not divide "
                    f"{bad} of {dirs[m.role]}; edit the plan to a t that does (and d = n_devices / t), or "
                    f"re-plan with `hybridflow plan ... {REPLAN_FLAGS}`"
                )
        if m.role == "actor" and (m.p * m.t) % (m.pg * m.tg):
            errors.append(f"{where}: generation pg*tg = {m.pg * m.tg} must divide p*t; fix the plan")
    return errors


def _layout_errors(where: str, m, limits: EngineLimits) -> list[str]:
    """The model's pipeline sizes beyond what the engines run under this config (`config_limits`)."""
    errors = []
    if not limits.allows(m.role, m.p, m.t):
        t = dict(limits.pipeline_max_tp).get(m.role)
        runs = "no pipeline" if t == 0 else f"pipelines with t <= {t}"
        errors.append(
            f"{where}: under this config the engines run {runs} for {m.role} (config/pipeline_roles.py); edit "
            f"the plan to p: 1 (and t*d = {m.n_devices}), or re-plan with `hybridflow plan ... {REPLAN_FLAGS}`"
        )
    if m.role == "actor" and limits.max_pg is not None and m.pg > limits.max_pg:
        errors.append(
            f"{where}: generation runs pipelines of pg <= {limits.max_pg}; edit the plan to pg: {limits.max_pg}, "
            f"or re-plan with `hybridflow plan ... {REPLAN_FLAGS}`"
        )
    return errors


def frozen_on_rollout_pool(p: Plan) -> set[str]:
    """Planner roles a one-step-ahead plan runs on its rollout pool (resources.frozen_pool=rollout; with
    both the reference also runs in the actor's pool, placement.py placement_from_plan)."""
    return set(p.ahead.frozen) if p.rollout_ahead and p.ahead is not None else set()


def used_pools(p: Plan, cfg) -> set[str]:
    roles = {PLANNER_ROLE[r] for r in trainer_roles(cfg)}
    return {m.pool for m in p.models if m.role in roles}


def report_plan(p: Plan, placement, cfg, source: str, stream) -> None:
    """Print the plan's tables, then what the run does differently from the plan or the config."""
    from rich.console import Console

    from hybridflow.planner.cli import print_plan

    console = Console(file=stream, width=160)
    origin = "planned (resources.placement=auto)" if source == "auto" else f"loaded from {source}"
    console.print(f"placement {origin}")
    print_plan(p, console, top=3)
    report_old_log_probs(p, cfg, console)
    report_schedule(p, cfg, console)
    idle = [pool.name for pool in p.pools if pool.name not in placement.pools]
    if idle:
        console.print(f"pools {idle} are not started: none of their models runs with this config")
    device = _device_or_none(cfg)
    if device is not None and p.device != device:
        console.print(f"note: the plan was made for {p.device!r} devices; this run's are {device!r}")
    sections = {"actor_rollout": cfg.actor, "ref": cfg.ref, "critic": cfg.critic, "reward": cfg.reward}
    for role, sizes in placement.parallel.items():
        own = sections.get(role)
        if own is not None and (own.parallel.tp, own.parallel.pp) != (sizes.tp, sizes.pp):
            console.print(
                f"note: the plan overrides {role}'s configured tp={own.parallel.tp} pp={own.parallel.pp} "
                f"with tp={sizes.tp} pp={sizes.pp}"
            )


def _device_or_none(cfg) -> str | None:
    try:
        return planner_device(cfg).name
    except ConfigError:
        return None
