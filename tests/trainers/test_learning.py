"""Learning, end to end and seeded: an SFT warm start, then GRPO and PPO each raise greedy validation
accuracy on held-out arithmetic problems by a clear margin (the short version of
scripts/learning_curves.py, whose longer runs are reported in docs/learning.md)."""

from __future__ import annotations

import pytest

from scripts.learning_curves import rl_overrides, train, val_acc, warm_start

MARGIN = 0.10  # absolute accuracy points; the runs below gain about twice that


@pytest.fixture(scope="module")
def sft_model(ray_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("learning")
    model_dir, history = warm_start(workdir, steps=150)
    # the warm start knows the format only partly: room for RL (and not a model that cannot add)
    assert 0.1 <= val_acc(history[-1]) <= 0.5, history[-1]
    return model_dir, workdir


@pytest.mark.parametrize("algorithm,steps", [("grpo", 40), ("ppo", 40)])
def test_rl_raises_validation_accuracy(sft_model, algorithm, steps):
    model_dir, workdir = sft_model
    history, trainer = train(rl_overrides(algorithm, model_dir, workdir / "runs", steps))
    trainer.close()
    before, after = val_acc(history[0]), val_acc(history[-1])
    rewards = [h["reward/mean"] for h in history if h["step"] > 0]
    print(
        f"{algorithm}: val acc {before:.3f} -> {after:.3f}; train reward {rewards[0]:.3f} -> {rewards[-1]:.3f}"
    )
    assert after - before >= MARGIN, (before, after)
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + MARGIN
