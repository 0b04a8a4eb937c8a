"""Checks of the actor's loss settings (`actor.policy_loss`, its clip ranges, `actor.rollout_correction`),
one line each, before any worker starts. Pure config, no torch (the functions: algorithms/policy_losses.py,
algorithms/rollout_correction.py)."""

from __future__ import annotations

import dataclasses

from hybridflow.config.schema import ActorConfig, RolloutCorrectionConfig

_DUAL_CLIP = next(f.default for f in dataclasses.fields(ActorConfig) if f.name == "clip_ratio_c")
_RC_DEFAULTS = RolloutCorrectionConfig()


def actor_loss_errors(actor) -> list[str]:
    """Problems of `actor` (an ActorConfig)'s loss settings."""
    errors = []  # the ranges of the clip ratios themselves: schema.actor_errors
    if actor.policy_loss != "vanilla" and actor.clip_ratio_c != _DUAL_CLIP:
        errors.append(f"actor.clip_ratio_c: the dual clip is policy_loss vanilla's; {actor.policy_loss} "
                      "does not use it, remove it")  # fmt: skip
    return errors + rollout_correction_errors(actor.rollout_correction)


def rollout_correction_errors(rc) -> list[str]:
    """Problems of a RolloutCorrectionConfig: bounds a mode would not use, or an impossible range."""
    key = "actor.rollout_correction"
    if rc.mode == "none":
        unused = [k for k in ("level", "lower", "upper") if getattr(rc, k) != getattr(_RC_DEFAULTS, k)]
        return [f"{key}.{k}: mode none corrects nothing, so it is not used; remove it" for k in unused]
    if rc.upper <= 0 or not 0 <= rc.lower < rc.upper:
        return [f"{key}: needs 0 <= lower < upper, got lower={rc.lower}, upper={rc.upper}"]
    if rc.mode == "tis" and rc.lower:
        return [f"{key}.lower: tis truncates from above only (min(rho, upper)); use mode mis or icepop "
                "for a lower bound, or remove it"]  # fmt: skip
    if rc.mode == "icepop" and rc.level != "token":
        return [f"{key}.level: icepop is per token; use mode mis for a sequence-level mask"]
    if rc.mode == "icepop" and not rc.lower:
        return [f"{key}.lower: icepop masks both sides of rho; set lower > 0 (IcePop: 0.5), or use mis"]
    return []
