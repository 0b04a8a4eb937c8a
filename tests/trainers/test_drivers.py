"""Each driver runs real steps on the tiny model with a local Ray cluster (real worker groups, gloo).

Runs are 2 steps each: what is checked is that every phase ran and produced the numbers its
algorithm defines (group-centred advantages, the greedy baseline, the Lagrange multiplier, ...).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.trainers import build_trainer

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
COST = f"algorithm.safe_rlhf.cost_fn={Path(__file__).parents[2] / 'examples/rewards/arithmetic_cost.py'}:non_numeric_cost"
COMMON = ("timing_s/gen", "timing_s/step", "timing_s/update_actor", "actor/pg_loss", "actor/grad_norm",
          "actor/entropy", "reward/mean", "response_length/mean", "perf/throughput")  # fmt: skip


def _step(trainer):
    batch = trainer.train_loader.next_batch()
    trainer.global_step += 1
    with trainer.timers("step"):
        out, metrics = trainer.train_step(batch)
    metrics.update(trainer.timers.pop())
    return out, metrics


def _check_common(metrics: dict) -> None:
    for key in COMMON[:-1]:
        assert key in metrics, f"missing metric {key}; have {sorted(metrics)}"
        assert math.isfinite(metrics[key])
    assert metrics["actor/grad_norm"] > 0  # dense reward: non-zero advantages move the actor


def _group_sums(batch) -> np.ndarray:
    adv = (batch["advantages"] * batch["response_mask"]).sum(-1) / batch["response_mask"].sum(-1)
    sums = {}
    for uid, a in zip(batch["uid"], adv.tolist()):
        sums[uid] = sums.get(uid, 0.0) + a
    return np.array(list(sums.values()))


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp", "remax"])
def test_critic_free_variants(ray_cluster, make_config, algorithm):
    extra = ("algorithm.use_kl_loss=true",) if algorithm == "grpo" else ("algorithm.kl.in_reward=true",)
    with build_trainer(make_config(algorithm, DIGITS, *extra)) as trainer:
        assert "critic" not in trainer.groups
        batch, metrics = _step(trainer)
        _check_common(metrics)
        assert len(batch) == 4 * 2
        if algorithm in ("grpo", "rloo"):  # advantages are centred within each prompt's group
            np.testing.assert_allclose(_group_sums(batch), 0.0, atol=1e-5)
        if algorithm == "grpo":
            assert "actor/kl_loss" in metrics
        if algorithm == "reinforce_pp":  # whitened over all valid tokens
            valid = batch["advantages"][batch["response_mask"].bool()]
            assert abs(float(valid.mean())) < 1e-5
        if algorithm == "remax":  # baseline = the greedy response's score, per prompt
            assert metrics["timing_s/gen_baseline"] > 0
            base = batch["reward_baselines"].view(-1, 2)
            assert torch.equal(base[:, 0], base[:, 1])
            seq_adv = (batch["advantages"] * batch["response_mask"]).sum(-1)
            expect = (batch["token_level_rewards"].sum(-1) - batch["reward_baselines"]) * batch[
                "response_mask"
            ].sum(-1)
            torch.testing.assert_close(seq_adv, expect, rtol=1e-4, atol=1e-4)
        if algorithm != "grpo":
            assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001)
        history = trainer.fit()  # the second step through the public loop, with validation
        assert history[-1]["step"] == 2
        assert "val/synthetic:arithmetic/acc@1" in history[-1]


def test_safe_rlhf_cost_critic_and_lagrangian(ray_cluster, make_config):
    cfg = make_config(
        "safe_rlhf", DIGITS, COST, "algorithm.safe_rlhf.cost_limit=0.1", "algorithm.safe_rlhf.lambda_init=0.5",
        "algorithm.safe_rlhf.lambda_lr=0.2", "rollout.n=1",
    )  # fmt: skip
    with build_trainer(cfg) as trainer:
        assert {"critic", "cost_critic"} <= set(trainer.groups)
        batch, metrics = _step(trainer)
        _check_common(metrics)
        for key in ("critic/vf_loss", "cost_critic/vf_loss", "critic/vf_explained_var"):
            assert math.isfinite(metrics[key])
        cost = float(batch["costs"].mean())
        assert metrics["safe_rlhf/cost_mean"] == pytest.approx(cost)
        assert metrics["safe_rlhf/lambda"] == pytest.approx(max(0.0, 0.5 + 0.2 * (cost - 0.1)))
        assert {"cost_values", "cost_returns"} <= set(batch.keys())
        state = trainer.extra_state()
        assert state["lagrange"] == pytest.approx(metrics["safe_rlhf/lambda"])


def test_ppo_batch_not_dividing_dp(ray_cluster, make_config):
    """3 prompts over dp=2: the controller pads, the workers drop the padding, rows stay aligned."""
    cfg = make_config(
        "ppo", DIGITS, "data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "actor.ppo_epochs=2",
        "rollout.n=1", "algorithm.kl.in_reward=true", devices=2,
    )  # fmt: skip
    with build_trainer(cfg) as trainer:
        assert not trainer.on_policy  # two epochs: old log-probs are recomputed by the actor group
        batch, metrics = _step(trainer)
        assert len(batch) == 3
        _check_common(metrics)
        # the recomputed old log-probs are those of the rows' own sampled tokens (not a neighbour's)
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(
            batch["old_log_probs"][mask], batch["rollout_log_probs"][mask], atol=1e-4, rtol=0
        )
        # step 1: the reference still equals the actor
        torch.testing.assert_close(
            batch["ref_log_probs"][mask], batch["old_log_probs"][mask], atol=1e-5, rtol=0
        )
        for key in ("critic/vf_loss", "critic/vf_explained_var", "timing_s/values", "timing_s/update_critic"):
            assert math.isfinite(metrics[key])


def test_dpo_steps(ray_cluster, make_config):
    cfg = make_config(
        "dpo", "data.dataset=synthetic:arithmetic_dpo", "data.train_batch_size=4", "data.shuffle=false",
        "data.dataset_kwargs={num_samples: 4, val_size: 6, max_operand: 9}", "algorithm.dpo.beta=0.5",
        "actor.micro_batch_size_per_device=3",
    )  # fmt: skip
    with build_trainer(cfg) as trainer:
        history = trainer.fit()
    first, last = history[1], history[2]
    # step 1: the actor equals the reference, so the implicit rewards are 0 and the loss is log 2
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert first["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert last["dpo/reward_margin"] > 0.01  # one step on the same 4 pairs separates them
    assert last["dpo/loss"] < math.log(2)
