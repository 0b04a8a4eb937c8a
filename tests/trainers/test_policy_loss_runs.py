"""Each `actor.policy_loss` trains end to end: two GRPO steps of the tiny model on a local Ray cluster, each
step two optimizer steps (so the second mini-batch's ratios are off 1 and the losses differ), with the
new aggregation modes and a mask-type rollout correction riding along. Seeded: the same config repeats
its numbers exactly on one machine, so four different losses must give four different curves (a loss
setting that were ignored would give vanilla's)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridflow.trainers import build_trainer

# a reward the random tiny model earns sometimes (share of digits), so GRPO's advantages are not all 0
DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
RUNS = {
    "vanilla": ("actor.loss_agg_mode=token-sum",),
    "gspo": (
        "actor.clip_ratio_low=3e-4",
        "actor.clip_ratio_high=4e-4",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ),
    "cispo": ("actor.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_agg_mode=seq-mean-token-sum-norm"),
    "geo_mean": ("actor.rollout_correction.mode=geo_mask", "actor.rollout_correction.lower=0.5"),
}


@pytest.fixture(scope="module")
def histories(ray_cluster, tiny_model_dir, tmp_path_factory):
    from tests.trainers.configs import tiny_config

    out = {}
    for name, extra in RUNS.items():
        cfg = tiny_config(tiny_model_dir, tmp_path_factory.mktemp(name), "grpo", f"actor.policy_loss={name}",
                          "actor.ppo_mini_batch_size=2", "trainer.val_before_train=false", DIGITS, *extra)  # fmt: skip
        with build_trainer(cfg) as trainer:
            out[name] = trainer.fit()
    return out


def test_every_policy_loss_trains_two_steps(histories):
    for name, history in histories.items():
        steps = [h for h in history if "actor/pg_loss" in h]
        assert len(steps) == 2, name
        for h in steps:
            assert all(
                math.isfinite(h[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac")
            ), name
            assert 0 <= h["actor/pg_clipfrac"] <= 1 and h["actor/step_skipped"] == 0, name
    losses = {
        name: tuple(h["actor/pg_loss"] for h in history if "actor/pg_loss" in h)
        for name, history in histories.items()
    }
    assert len(set(losses.values())) == len(losses), losses


def test_the_geometric_mask_reports_what_it_dropped(histories):
    """fp32: the geometric-mean ratio of every sequence is 1 within rounding, inside [0.5, 2]: nothing masked."""
    for h in histories["geo_mean"]:
        if "actor/is_masked_frac" in h:
            assert h["actor/is_masked_frac"] == 0.0 and h["actor/is_weight_mean"] == pytest.approx(1.0)
