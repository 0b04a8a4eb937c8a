"""DAPO's settings (Yu et al. 2025) and their consistency checks: dynamic sampling
(`algorithm.filter_groups`), overlong reward shaping (`reward.overlong_buffer`) and the masking of
truncated responses (`actor.mask_truncated`). Names follow verl's DAPO recipe where it has them.

All three are carried out by the `dapo` driver (trainers/dapo.py): another algorithm given one of
them is refused in one line rather than running without it. Importable without torch or Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.fields import setting as _f


@dataclass
class FilterGroupsConfig:
    """Dynamic sampling: drop groups whose samples all score the same, sample more prompts to refill."""

    enable: bool = _f(
        False, "drop all-equal groups and generate more until the batch is full (algorithm.name=dapo)"
    )
    metric: str = _f(
        "score",
        "what must vary within a kept group: score (the shaped sequence score, verl's seq_final_reward) or "
        "acc (the rule reward's returned `acc` key)",
        choices=("score", "acc"),
    )
    max_num_gen_batches: int = _f(
        10,
        "generation batches a step may use before it stops the run in one line (0 = unlimited, as verl)",
        ge=0,
    )


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment of responses near rollout.response_length (algorithm.name=dapo)."""

    enable: bool = _f(False, "penalise responses longer than rollout.response_length - len")
    len: int = _f(
        0, "buffer tokens before the cap over which the penalty grows linearly to penalty_factor", ge=0
    )
    penalty_factor: float = _f(
        1.0, "the penalty at the cap: reward -= min(excess / len, 1) * penalty_factor", ge=0
    )


def dapo_errors(cfg) -> list[str]:
    """The problems of a resolved config's DAPO settings, one message each, starting with the key."""
    fg, ob, is_dapo = cfg.algorithm.filter_groups, cfg.reward.overlong_buffer, cfg.algorithm.name == "dapo"
    errors = []
    if not is_dapo:
        given = {
            "algorithm.filter_groups.enable": fg.enable,
            "reward.overlong_buffer.enable": ob.enable,
            "actor.mask_truncated": cfg.actor.mask_truncated,
        }
        errors += [
            f"{key}: runs in the dapo driver only (DAPO = GRPO advantages + these); set algorithm.name=dapo "
            f"instead of {cfg.algorithm.name}"
            for key, on in given.items()
            if on
        ]
    if fg.enable and fg.metric == "acc" and cfg.reward.kind == "model":
        errors.append(
            "algorithm.filter_groups.metric: 'acc' is a key a rule reward returns; a reward model returns "
            "scores only, so use 'score'"
        )
    if ob.enable and not 0 < ob.len <= cfg.rollout.response_length:
        errors.append(
            f"reward.overlong_buffer.len: must be in [1, rollout.response_length={cfg.rollout.response_length}], "
            f"got {ob.len}"
        )
    if is_dapo and cfg.trainer.rollout_ahead:
        errors.append(
            "trainer.rollout_ahead: 1 is not supported by the dapo driver yet (with dynamic sampling, which "
            "prompts a step trains on is known only after scoring its groups); use 0"
        )
    return errors
