"""trainer.rollout_ahead=1: how resources.num_devices splits into training and rollout, and what that
schedule cannot serve yet (one line each). Pure config arithmetic, no torch: validation, placement
(trainers/placement.py) and resolve_config's dp sizes read the same split (docs/design.md,
"One-step-ahead rollout")."""

from __future__ import annotations


def rollout_devices(cfg) -> int:
    """Devices of the rollout pool: 0 without trainer.rollout_ahead, else resources.rollout_devices
    (0 = half of the devices, rounded down)."""
    if not cfg.trainer.rollout_ahead:
        return 0
    return cfg.resources.rollout_devices or cfg.resources.num_devices // 2


FROZEN_ROLES = ("ref", "reward", "cost")  # models that never train: they may score on the rollout pool


def frozen_on_rollout(cfg) -> bool:
    """Whether the frozen models (FROZEN_ROLES) run in the rollout pool's processes under colocate / split
    placement: trainer.rollout_ahead=1 with resources.frozen_pool rollout or auto (under auto / a plan file
    the plan says, trainers/auto_placement.py). They score step k+1's batch there right after generating
    it (trainers/sources/ahead.py), so the training pool only runs the actor (and critic)."""
    res = cfg.resources
    if not cfg.trainer.rollout_ahead or res.frozen_pool == "training":
        return False
    return res.frozen_pool in ("rollout", "both") or res.placement in ("colocate", "split")


def ref_on_both_pools(cfg) -> bool:
    """resources.frozen_pool=both under colocate / split: the reference also joins the actor's workers, and
    each step's rows are split between the two pools (trainers/sources/ahead.py, RefSplit); under auto / a
    plan file the plan says (trainers/auto_placement.py)."""
    return bool(cfg.trainer.rollout_ahead) and cfg.resources.frozen_pool == "both"


def with_frozen_on_rollout(cfg, devices: dict[str, int] | None) -> dict[str, int] | None:
    """Devices of each model section's pool (config/validate.section_devices), the frozen models' (ref and
    reward sections; the cost model reads reward's) moved to the rollout pool when they run there."""
    if devices is None or not frozen_on_rollout(cfg):
        return devices
    return {**devices, "ref": rollout_devices(cfg), "reward": rollout_devices(cfg)}


def training_devices(cfg) -> int:
    """Devices left for the training pools (every role but the rollout)."""
    return cfg.resources.num_devices - rollout_devices(cfg)


def rollout_ahead_errors(cfg, spec) -> list[str]:
    """Problems of the rollout_ahead settings (`spec`: the algorithm's AlgorithmSpec, None if unknown)."""
    trainer_cfg, res = cfg.trainer, cfg.resources
    n, r = res.num_devices, res.rollout_devices
    if not trainer_cfg.rollout_ahead:
        errors = []
        if r:
            errors.append(
                f"resources.rollout_devices: {r} is only used with trainer.rollout_ahead=1; remove it"
            )
        if res.frozen_pool != "auto":
            errors.append(
                f"resources.frozen_pool: {res.frozen_pool!r} is only used with trainer.rollout_ahead=1 (the "
                "frozen models share the training pools otherwise); remove it"
            )
        return errors
    if spec is not None and not spec.generation:
        return [
            f"trainer.rollout_ahead: {spec.name} trains on a fixed dataset, nothing to generate ahead; use 0"
        ]
    if n < 2:
        return [
            f"trainer.rollout_ahead: 1 needs at least 2 devices (a training pool and a rollout pool), "
            f"resources has {n}; raise resources.n_gpus_per_node or use 0"
        ]
    errors = []
    frozen = [role for role in spec.roles(cfg) if role in FROZEN_ROLES] if spec is not None else None
    if res.frozen_pool != "auto" and frozen == []:
        errors.append(
            f"resources.frozen_pool: {res.frozen_pool!r} places nothing: this run has no reference, reward or "
            "cost model (no KL term, rule rewards); remove it"
        )
    elif res.frozen_pool == "both" and frozen is not None and "ref" not in frozen:
        errors.append(
            "resources.frozen_pool: both splits the reference's rows between the pools, and this run has no "
            "reference (no KL term); use rollout or training"
        )
    if not 0 <= r < n:
        errors.append(
            f"resources.rollout_devices: must leave training at least one of the {n} devices "
            f"(0 < rollout_devices < {n}, or 0 = {n // 2}), got {r}"
        )
    # auto / a plan file: the plan sizes and lays out the rollout pool (trainers/plan_schedule.py checks it)
    placement, tg = res.placement, cfg.rollout.tg
    if placement == "split" and 0 <= r < n and n - rollout_devices(cfg) < 2:
        errors.append(
            f"resources.placement: split needs 2 training devices besides the rollout pool's "
            f"{rollout_devices(cfg)} of {n}; lower resources.rollout_devices or add devices"
        )
    if placement in ("colocate", "split") and 0 <= r < n and tg >= 1 and rollout_devices(cfg) % tg:
        errors.append(
            f"rollout.tg: {tg} must divide the rollout pool's {rollout_devices(cfg)} devices (its generation "
            "TP groups); change resources.rollout_devices or rollout.tg"
        )
    return errors
