"""Derived values and consistency checks, run before any worker starts.

`resolve_config` fills the fields documented as "0 / '' = derive" so the trainer reads concrete
numbers. `validate_config` collects every inconsistency (each naming its key and a fix) and raises
one ConfigError: failing at step 0 with a clear message beats failing at step 1 inside a worker.
First every leaf is checked against the domain its field declares (hybridflow/fields.py `domain_errors`:
ranges, finiteness, choices); the checks after it may assume in-domain values.
Each section's own checks live beside its definition (config/schema.py, config/algorithm_config.py,
config/run_config.py, engines/config.py; SECTION_CHECKS); those here relate sections to each other (batch arithmetic, the
algorithm's needs, pools and layouts).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from hybridflow.config.actor_loss import actor_loss_errors
from hybridflow.config.agent import absolute_specs
from hybridflow.config.algorithm_config import algorithm_errors
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.config.dapo import dapo_errors
from hybridflow.config.model_checks import data_and_model_errors
from hybridflow.config.pipeline_roles import pipeline_role_errors
from hybridflow.config.rollout_pool import rollout_ahead_errors, training_devices, with_frozen_on_rollout
from hybridflow.config.run_config import resources_errors, trainer_errors
from hybridflow.config.schema import (
    HybridFlowConfig,
    ParallelConfig,
    actor_errors,
    critic_errors,
    data_errors,
    model_errors,
    ref_errors,
    reward_errors,
    rollout_errors,
)
from hybridflow.engines.config import parallel_errors
from hybridflow.errors import ConfigError
from hybridflow.fields import domain_errors
from hybridflow.hybrid_engine.layout import generation_layout_errors
from hybridflow.rollout.factory import rollout_engine_errors

# Settings accepted by the schema whose other values are not implemented yet: key -> (the values
# that work, why). `collect_errors` rejects the rest in one line each; a colleague implementing one
# removes its entry (tests/config/test_fields_read.py checks every entry is rejected).
# (Every section's parallel.pp > 1 runs now: config/pipeline_roles.py says with what.)
NOT_YET: dict[str, tuple[tuple, str]] = {}
# The section each model's pool size is read from, per placement (the planner fills auto/plan files).
_ACTOR_SIDE = ("actor", "ref")


def split_sizes(num_devices: int) -> tuple[int, int]:
    """resources.placement=split: (actor + ref pool, critic + reward pool) device counts."""
    return num_devices - num_devices // 2, num_devices // 2


def section_devices(cfg: HybridFlowConfig) -> dict[str, int] | None:
    """Devices of the pool each model section runs on, or None where the planner decides (auto/plan).
    With trainer.rollout_ahead=1 the rollout pool's devices are not among them, except for the frozen
    models when they run there (config/rollout_pool.py)."""
    n, placement = training_devices(cfg), cfg.resources.placement
    if placement == "colocate":
        return with_frozen_on_rollout(cfg, dict.fromkeys(("actor", "critic", "ref", "reward"), n))
    if placement == "split":
        actor, critic = split_sizes(n)
        sizes = {s: actor if s in _ACTOR_SIDE else critic for s in ("actor", "critic", "ref", "reward")}
        return with_frozen_on_rollout(cfg, sizes)
    return None


def _mini_batches(train_batch_size: int, mini: int) -> int:
    return max(1, train_batch_size // mini) if mini >= 1 else 0  # validation rejects what does not divide


def _dp(p: ParallelConfig, devices: int) -> int:
    return devices // (p.tp * p.pp) if p.tp >= 1 and p.pp >= 1 and devices % (p.tp * p.pp) == 0 else 0


def resolve_config(cfg: HybridFlowConfig) -> HybridFlowConfig:
    """Return a copy with derived values filled in: adv_estimator, critic mini-batch/epochs, the
    mini-batch counts and the dp sizes (the batch arithmetic every reader then takes from here)."""
    cfg = _copy(cfg)
    a = cfg.algorithm
    if not a.adv_estimator and a.name in ALGORITHM_SPECS:
        a.adv_estimator = ALGORITHM_SPECS[a.name].adv_estimator
    if cfg.critic.ppo_mini_batch_size == 0:
        cfg.critic.ppo_mini_batch_size = cfg.actor.ppo_mini_batch_size
    if cfg.critic.ppo_epochs == 0:
        cfg.critic.ppo_epochs = cfg.actor.ppo_epochs
    # derived fields: always recomputed (a user value that disagrees: derived_conflicts)
    cfg.actor.num_mini_batches = _mini_batches(cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size)
    cfg.critic.num_mini_batches = _mini_batches(cfg.data.train_batch_size, cfg.critic.ppo_mini_batch_size)
    absolute_specs(cfg.rollout.multi_turn)  # Ray workers run in another working directory
    if cfg.data.dataset.startswith("reasoning_gym:") and "reasoning_gym" not in cfg.reward.preload:
        cfg.reward.preload.append("reasoning_gym")  # its import alone can outlast a sample's timeout
    if cfg.algorithm.sft.max_length == 0:
        cfg.algorithm.sft.max_length = cfg.data.max_prompt_length + cfg.rollout.response_length
    # dp derives where the pool sizes follow from the config (colocate, split); auto / a plan file
    # leave 0 and the plan's sizes are written into each role's config (trainers/placement.role_config).
    devices = section_devices(cfg)
    for key, p in _parallel_configs(cfg).items():
        if devices is not None and p.dp == 0:
            p.dp = _dp(p, devices[key.partition(".")[0]])
    return cfg


def derived_conflicts(given, resolved, prefix: str = "") -> list[str]:
    """Derived fields the user set (non-zero in `given`) to something other than their resolved value."""
    errors = []
    for f in dataclasses.fields(given):
        mine, theirs = getattr(given, f.name), getattr(resolved, f.name)
        if dataclasses.is_dataclass(mine):
            errors += derived_conflicts(mine, theirs, prefix + f.name + ".")
        elif f.metadata.get("derived") and mine and mine != theirs:
            errors.append(
                f"{prefix}{f.name}: is derived ({f.metadata['help'].removeprefix('derived: ')} = {theirs}), "
                f"got {mine}; remove it and set what it derives from"
            )
    return errors


def _copy(cfg):
    from hybridflow.config.loader import config_from_dict, config_to_dict

    return config_from_dict(config_to_dict(cfg), type(cfg))


def _parallel_configs(cfg: HybridFlowConfig) -> dict[str, ParallelConfig]:
    return {
        "actor.parallel": cfg.actor.parallel,
        "critic.parallel": cfg.critic.parallel,
        "ref.parallel": cfg.ref.parallel,
        "reward.parallel": cfg.reward.parallel,
    }


# each section's own checks, beside its definition; collect_errors adds those across sections
SECTION_CHECKS = {
    "algorithm": algorithm_errors,
    "model": model_errors,
    "data": data_errors,
    "actor": actor_errors,
    "rollout": rollout_errors,
    "critic": critic_errors,
    "ref": ref_errors,
    "reward": reward_errors,
    "resources": resources_errors,
    "trainer": trainer_errors,
}


def collect_errors(cfg: HybridFlowConfig, check_model: bool = True) -> list[str]:
    """All problems of a resolved config, as messages that start with the offending key."""
    errors = domain_errors(cfg)  # every leaf's declared range and choices (hybridflow/fields.py)
    if errors:  # the checks below relate values to each other, and assume each is in its domain
        return errors
    spec = ALGORITHM_SPECS.get(cfg.algorithm.name)
    errors += _not_yet_errors(cfg)
    for name, check in SECTION_CHECKS.items():
        errors += check(getattr(cfg, name))
    errors += _mini_batch_errors(cfg, spec)
    errors += _algorithm_errors(cfg, spec)
    errors += rollout_engine_errors(cfg)
    errors += rollout_ahead_errors(cfg, spec) + dapo_errors(cfg) + actor_loss_errors(cfg.actor)
    errors += data_and_model_errors(cfg, spec, check_model)
    errors += _parallel_errors(cfg, spec)
    errors += _devices_errors(cfg)
    errors += _lora_errors(cfg)
    return errors


def _lora_errors(cfg: HybridFlowConfig) -> list[str]:
    """LoRA runs where the generation weights are merged on the actor's own ranks (hybrid_engine/resharder.py):
    the built-in engine reads them, vLLM and the rollout pool of rollout_ahead=1 are sent them."""
    if not cfg.model.lora.enabled:
        return []
    errors = []
    if importlib.util.find_spec("peft") is None:
        errors.append(
            f"model.lora.rank={cfg.model.lora.rank}: LoRA needs the peft package: pip install 'hybridflow[lora]'"
        )
    return errors


def _not_yet_errors(cfg: HybridFlowConfig) -> list[str]:
    errors = []
    for key, (works, why) in NOT_YET.items():
        value = _get(cfg, key)
        if value not in works:
            errors.append(f"{key}: {value!r} is not supported yet ({why}); use {works[0]!r}")
    return errors


def _mini_batch_errors(cfg: HybridFlowConfig, spec) -> list[str]:
    """Mini-batches (prompts) tile the batch exactly: the actor's, and the critic's where it runs."""
    errors, batch, actor_mini = [], cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    for section in ("actor", "critic"):
        mini = getattr(cfg, section).ppo_mini_batch_size
        if section == "critic" and (not (spec and spec.critic) or mini == actor_mini):
            continue  # no critic, or the same number already checked for the actor
        if mini > batch:
            errors.append(f"{section}.ppo_mini_batch_size: {mini} is larger than data.train_batch_size "
                          f"{batch}; lower it or raise the batch")  # fmt: skip
        elif mini >= 1 and batch % mini:
            errors.append(
                f"{section}.ppo_mini_batch_size: data.train_batch_size {batch} is not divisible "
                f"by {mini}; choose a divisor (e.g. {_nearest_divisor(batch, mini)})"
            )
    return errors


def _algorithm_errors(cfg: HybridFlowConfig, spec) -> list[str]:
    """What the algorithm needs of the other sections, from its spec (config/algorithms.py)."""
    if spec is None:
        return []
    a, errors = cfg.algorithm, []
    if cfg.rollout.n < spec.min_n:
        errors.append(f"rollout.n: {a.name} normalises rewards within a group of samples and needs "
                      f"n >= {spec.min_n}, got {cfg.rollout.n}")  # fmt: skip
    if a.adv_estimator != spec.adv_estimator:
        same = " or ".join(n for n, s in ALGORITHM_SPECS.items() if s.adv_estimator == a.adv_estimator)
        errors.append(
            f"algorithm.adv_estimator: {a.adv_estimator!r} is not {a.name}'s estimator ({spec.adv_estimator!r}); "
            f"each algorithm has its own, so set algorithm.name={same or '...'} instead"
        )
    if spec.cost and not a.safe_rlhf.cost_fn and not cfg.model.cost_model_path:
        errors.append(f"algorithm.safe_rlhf.cost_fn: {a.name} needs a cost; set it or model.cost_model_path")
    if not spec.generation and not cfg.trainer.overlap_phases:
        errors.append(
            f"trainer.overlap_phases: {a.name} has one phase per step, nothing to overlap; remove it"
        )
    if cfg.resources.placement not in ("colocate", "split") and not spec.planner:
        errors.append(
            f"resources.placement: the planner ('auto' or a plan file) has no dataflow for {a.name!r}, "
            "which only trains the actor; use colocate"
        )
    return errors


def _parallel_errors(cfg: HybridFlowConfig, spec) -> list[str]:
    """Where pool sizes follow from the config, each dp must be what they give; the generation layout."""
    errors, n, devices = [], cfg.resources.num_devices, section_devices(cfg)
    for key, p in _parallel_configs(cfg).items():
        if parallel_errors(p, key):
            errors += parallel_errors(p, key)
            continue
        pool = devices[key.partition(".")[0]] if devices else n
        if devices and pool % (p.tp * p.pp):
            errors.append(f"{key}: tp*pp = {p.tp * p.pp} does not divide the {pool} devices of its pool")
        elif devices and p.dp != _dp(p, pool):
            errors.append(f"{key}.dp: its pool has {pool} devices and tp*pp = {p.tp * p.pp}, so dp must be "
                          f"{_dp(p, pool)} (or 0 to derive it), got {p.dp}")  # fmt: skip
        elif p.dp and p.tp * p.pp * p.dp > n:
            errors.append(f"{key}: tp*pp*dp = {p.tp * p.pp * p.dp} exceeds the {n} devices")
    r, act, batch = cfg.rollout, cfg.actor, cfg.data.train_batch_size
    model_dir = cfg.model.path if os.path.isdir(cfg.model.path) else None
    errors += generation_layout_errors(act.parallel, r.tg, r.pg, model_dir, r.reshard)
    errors += pipeline_role_errors(cfg)
    if spec and spec.pairs and act.parallel.dp and batch % act.parallel.dp:
        errors.append(
            f"data.train_batch_size: {batch} pairs must divide evenly over the actor's "
            f"dp={act.parallel.dp} ranks (both rows of a pair must land on the same rank)"
        )
    return errors


def _devices_errors(cfg: HybridFlowConfig) -> list[str]:
    t, n = cfg.trainer, cfg.resources.num_devices
    if t.min_devices > n:
        return [f"trainer.min_devices: {t.min_devices} exceeds the run's {n} devices"]
    return []


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _nearest_divisor(total: int, near: int) -> int:
    """The divisor of `total` closest to `near` (the larger on a tie), searched outward from `near` and
    only so far, so a batch of any size answers at once (1 always divides)."""
    for step in range(min(near, 10**5)):
        for k in (near + step, near - step):
            if 1 <= k <= total and total % k == 0:
                return k
    return 1


def validate_config(cfg: HybridFlowConfig, check_model: bool = True) -> None:
    """Raise ConfigError listing every problem of a resolved config (see `collect_errors`)."""
    errors = collect_errors(cfg, check_model=check_model)
    if errors:
        raise ConfigError(errors)
