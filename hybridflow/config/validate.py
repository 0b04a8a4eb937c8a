"""Derived values and consistency checks, run before any worker starts.

`resolve_config` fills the fields documented as "0 / '' = derive" so the trainer reads concrete
numbers. `validate_config` collects every inconsistency (each naming its key and a fix) and raises
one ConfigError: failing at step 0 with a clear message beats failing at step 1 inside a worker.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re

from hybridflow.config.actor_loss import actor_loss_errors
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.config.loader import ConfigError
from hybridflow.config.model_checks import data_and_model_errors
from hybridflow.config.rollout_pool import rollout_ahead_errors, training_devices, with_frozen_on_rollout
from hybridflow.config.schema import LOGGERS, HybridFlowConfig, ParallelConfig
from hybridflow.hybrid_engine.layout import generation_layout_errors
from hybridflow.rollout.factory import rollout_engine_errors

# Settings accepted by the schema whose other values are not implemented yet: key -> (the values
# that work, why). `collect_errors` rejects the rest in one line each; a colleague implementing one
# removes its entry (tests/config/test_fields_read.py checks every entry is rejected).
NOT_YET = {
    # the actor's pp and rollout.tg/pg are checked with the generation layout (hybrid_engine/layout.py)
    f"{s}.parallel.pp": ((1,), "pipeline parallelism is not implemented; raise tp or dp instead")
    for s in ("critic", "ref", "reward")
}
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


def _check_choices(obj, prefix: str, errors: list[str]) -> None:
    """Every field with `choices` metadata holds one of them (recursing into nested configs)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        path = prefix + f.name
        if dataclasses.is_dataclass(value):
            _check_choices(value, path + ".", errors)
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            choices = [c for c in f.metadata["choices"] if c]
            near = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            errors.append(f"{path}: {value!r} is not one of {choices}{hint}")


def collect_errors(cfg: HybridFlowConfig, check_model: bool = True) -> list[str]:
    """All problems of a resolved config, as messages that start with the offending key."""
    errors: list[str] = []
    _check_choices(cfg, "", errors)
    for key, (works, why) in NOT_YET.items():
        value = _get(cfg, key)
        if value not in works:
            errors.append(f"{key}: {value!r} is not supported yet ({why}); use {works[0]!r}")
    a, d, act, r, t = cfg.algorithm, cfg.data, cfg.actor, cfg.rollout, cfg.trainer
    spec = ALGORITHM_SPECS.get(a.name)  # None: an unknown name, already reported

    # sizes
    for key, v in {
        "data.train_batch_size": d.train_batch_size,
        "data.max_prompt_length": d.max_prompt_length,
        "actor.ppo_mini_batch_size": act.ppo_mini_batch_size,
        "actor.ppo_epochs": act.ppo_epochs,
        "actor.micro_batch_size_per_device": act.micro_batch_size_per_device,
        "critic.micro_batch_size_per_device": cfg.critic.micro_batch_size_per_device,
        "ref.micro_batch_size_per_device": cfg.ref.micro_batch_size_per_device,
        "rollout.n": r.n,
        "rollout.val.n": r.val.n,
        "rollout.response_length": r.response_length,
        "rollout.tg": r.tg,
        "rollout.pg": r.pg,
        "resources.n_gpus_per_node": cfg.resources.n_gpus_per_node,
        "resources.nnodes": cfg.resources.nnodes,
        "trainer.keep_last": t.keep_last,
        "trainer.max_skipped_steps": t.max_skipped_steps,
    }.items():
        if v < 1:
            errors.append(f"{key}: must be >= 1, got {v}")
    for key, v in {
        "data.val_batch_size": d.val_batch_size,
        "trainer.total_steps": t.total_steps,
        "trainer.total_epochs": t.total_epochs,
        "trainer.val_every": t.val_every,
        "trainer.save_every": t.save_every,
        "actor.max_tokens_per_micro_batch": act.max_tokens_per_micro_batch,
        "critic.max_tokens_per_micro_batch": cfg.critic.max_tokens_per_micro_batch,
        "ref.max_tokens_per_micro_batch": cfg.ref.max_tokens_per_micro_batch,
        "reward.num_workers": cfg.reward.num_workers,
        "reward.chunk_size": cfg.reward.chunk_size,
    }.items():
        if v < 0:
            errors.append(f"{key}: must be >= 0, got {v}")
    if not 0.0 <= cfg.reward.max_error_fraction <= 1.0:
        errors.append(f"reward.max_error_fraction: must be in [0, 1], got {cfg.reward.max_error_fraction}")
    for key, v in {
        "reward.max_abs_score": cfg.reward.max_abs_score,
        "reward.startup_timeout_s": cfg.reward.startup_timeout_s,
    }.items():
        if not v > 0:
            errors.append(f"{key}: must be > 0, got {v}")
    if spec and not spec.generation and not t.overlap_phases:
        errors.append(
            f"trainer.overlap_phases: {a.name} has one phase per step, nothing to overlap; remove it"
        )
    if t.total_steps == 0 and t.total_epochs == 0:
        errors.append("trainer.total_steps: both total_steps and total_epochs are 0; set one of them")

    # mini-batches (prompts) must tile the batch exactly
    for section in ("actor", "critic"):
        if section == "critic" and (
            not (spec and spec.critic) or cfg.critic.ppo_mini_batch_size == act.ppo_mini_batch_size
        ):
            continue  # no critic, or the same number already checked for the actor
        mini = getattr(cfg, section).ppo_mini_batch_size
        if mini > d.train_batch_size:
            errors.append(
                f"{section}.ppo_mini_batch_size: {mini} is larger than data.train_batch_size "
                f"{d.train_batch_size}; lower it or raise the batch"
            )
        elif mini >= 1 and d.train_batch_size % mini:
            errors.append(
                f"{section}.ppo_mini_batch_size: data.train_batch_size {d.train_batch_size} is not divisible "
                f"by {mini}; choose a divisor (e.g. {_nearest_divisor(d.train_batch_size, mini)})"
            )

    # algorithm: what it needs comes from its spec (config/algorithms.py)
    if spec and r.n < spec.min_n:
        errors.append(
            f"rollout.n: {a.name} normalises rewards within a group of samples and needs n >= {spec.min_n}, "
            f"got {r.n}"
        )
    if spec and a.adv_estimator != spec.adv_estimator:
        same = " or ".join(n for n, s in ALGORITHM_SPECS.items() if s.adv_estimator == a.adv_estimator)
        errors.append(
            f"algorithm.adv_estimator: {a.adv_estimator!r} is not {a.name}'s estimator ({spec.adv_estimator!r}); "
            f"each algorithm has its own, so set algorithm.name={same or '...'} instead"
        )
    if spec and spec.cost and not a.safe_rlhf.cost_fn and not cfg.model.cost_model_path:
        errors.append(f"algorithm.safe_rlhf.cost_fn: {a.name} needs a cost; set it or model.cost_model_path")
    for key, v in {"algorithm.gamma": a.gamma, "algorithm.lam": a.lam}.items():
        if not 0.0 <= v <= 1.0:
            errors.append(f"{key}: must be in [0, 1], got {v}")
    if not 0.0 <= a.dpo.label_smoothing < 0.5:
        errors.append(f"algorithm.dpo.label_smoothing: must be in [0, 0.5), got {a.dpo.label_smoothing}")
    for key, optim in {"actor.optim": act.optim, "critic.optim": cfg.critic.optim}.items():
        if optim.lr < 0:  # 0 freezes the model (e.g. to check that a pipeline changes nothing)
            errors.append(f"{key}.lr: must be >= 0, got {optim.lr}")
        for name in ("warmup_steps", "total_steps"):
            if getattr(optim, name) < 0:
                errors.append(f"{key}.{name}: must be >= 0, got {getattr(optim, name)}")
        if len(optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in optim.betas):
            errors.append(f"{key}.betas: expected two numbers in [0, 1), got {optim.betas}")

    # sampling
    for key, v in {
        "rollout.temperature": r.temperature,
        "rollout.val.temperature": r.val.temperature,
    }.items():
        if v < 0:
            errors.append(f"{key}: must be >= 0, got {v}")
    for key, v in {"rollout.top_p": r.top_p, "rollout.val.top_p": r.val.top_p}.items():
        if not 0.0 < v <= 1.0:
            errors.append(f"{key}: must be in (0, 1], got {v}")
    errors += rollout_engine_errors(cfg)
    errors += rollout_ahead_errors(cfg, spec)
    errors += actor_loss_errors(cfg.actor)

    errors += data_and_model_errors(cfg, spec, check_model)

    # parallelism: where pool sizes follow from the config, dp must be what they give
    n, devices = cfg.resources.num_devices, section_devices(cfg)
    for key, p in _parallel_configs(cfg).items():
        if p.tp < 1 or p.pp < 1 or p.dp < 0:
            errors.append(f"{key}: tp and pp must be >= 1 and dp >= 0, got tp={p.tp} pp={p.pp} dp={p.dp}")
            continue
        pool = devices[key.partition(".")[0]] if devices else n
        if devices and pool % (p.tp * p.pp):
            errors.append(f"{key}: tp*pp = {p.tp * p.pp} does not divide the {pool} devices of its pool")
        elif devices and p.dp != _dp(p, pool):
            errors.append(f"{key}.dp: its pool has {pool} devices and tp*pp = {p.tp * p.pp}, so dp must be "
                          f"{_dp(p, pool)} (or 0 to derive it), got {p.dp}")  # fmt: skip
        elif p.dp and p.tp * p.pp * p.dp > n:
            errors.append(f"{key}: tp*pp*dp = {p.tp * p.pp * p.dp} exceeds the {n} devices")
    model_dir = cfg.model.path if os.path.isdir(cfg.model.path) else None
    errors += generation_layout_errors(cfg.actor.parallel, r.tg, r.pg, model_dir, r.reshard)
    if spec and spec.pairs and act.parallel.dp and d.train_batch_size % act.parallel.dp:
        errors.append(
            f"data.train_batch_size: {d.train_batch_size} pairs must divide evenly over the actor's "
            f"dp={act.parallel.dp} ranks (both rows of a pair must land on the same rank)"
        )

    if cfg.model.share_prompt is True and cfg.model.remove_padding is False:
        errors.append(
            "model.share_prompt: true needs padding removal (shared prompts live in packed rows), but "
            "model.remove_padding is false; set share_prompt to null or false, or remove_padding to null or true"
        )

    # run
    for name in t.loggers:
        if name not in LOGGERS:
            errors.append(f"trainer.loggers: unknown logger {name!r}; choose from {list(LOGGERS)}")
    resume = str(t.resume).strip()
    if (
        resume not in ("auto", "never")
        and not re.fullmatch(r"(step_)?\d+", resume)
        and not os.path.exists(resume)
    ):
        errors.append(
            f"trainer.resume: {t.resume!r} is neither 'auto', 'never', a step number nor an existing checkpoint path"
        )
    name = t.experiment_name
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        errors.append(
            f"trainer.experiment_name: {name!r} must be a relative name inside trainer.output_dir (no '..', not absolute)"
        )
    for key in ("max_restarts", "save_every_minutes", "stop_grace_s", "restart_wait_s", "min_devices"):
        if getattr(t, key) < 0:
            errors.append(f"trainer.{key}: must be >= 0, got {getattr(t, key)}")
    if t.min_devices > cfg.resources.num_devices:
        errors.append(
            f"trainer.min_devices: {t.min_devices} exceeds the run's {cfg.resources.num_devices} devices"
        )
    placement = cfg.resources.placement
    if placement not in ("colocate", "split", "auto") and not os.path.isfile(placement):
        errors.append(
            f"resources.placement: {placement!r} is not colocate|split|auto or an existing plan file"
        )
    if placement not in ("colocate", "split") and spec and not spec.planner:
        errors.append(
            f"resources.placement: the planner ('auto' or a plan file) has no dataflow for {a.name!r}, "
            "which only trains the actor; use colocate"
        )
    return errors


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _nearest_divisor(total: int, near: int) -> int:
    divisors = [k for k in range(1, total + 1) if total % k == 0]
    return min(divisors, key=lambda k: (abs(k - near), -k))


def validate_config(cfg: HybridFlowConfig, check_model: bool = True) -> None:
    """Raise ConfigError listing every problem of a resolved config (see `collect_errors`)."""
    errors = collect_errors(cfg, check_model=check_model)
    if errors:
        raise ConfigError(errors)
