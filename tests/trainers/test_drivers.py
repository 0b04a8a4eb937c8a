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

from hybridflow.algorithms import compute_gae, place_score_on_last_token
from hybridflow.logging.report import PANELS, empty_panels, panel_series
from hybridflow.trainers import build_trainer
from hybridflow.trainers.sources import old_log_prob_source
from tests.trainers.configs import tiny_config

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
COST = f"algorithm.safe_rlhf.cost_fn={Path(__file__).parents[2] / 'examples/rewards/arithmetic_cost.py'}:non_numeric_cost"
KL = ("algorithm.use_kl_loss=true", "algorithm.kl.in_reward=true")
COMMON = ("timing_s/gen", "timing_s/step", "timing_s/update_actor", "actor/pg_loss", "actor/grad_norm",
          "actor/entropy", "reward/mean", "response_length/mean")  # fmt: skip


def _step(trainer):
    batch = trainer.train_loader.next_batch()
    trainer.global_step += 1
    batch.meta.global_step = trainer.global_step
    with trainer.timers("step"):
        out, metrics = trainer.train_step(batch)
    metrics.update(trainer.timers.pop())
    return out, metrics


def _check_common(metrics: dict) -> None:
    for key in COMMON:
        assert key in metrics, f"missing metric {key}; have {sorted(metrics)}"
        assert math.isfinite(metrics[key])
    assert metrics["actor/grad_norm"] > 0  # dense reward: non-zero advantages move the actor


def _group_sums(batch) -> np.ndarray:
    adv = (batch["advantages"] * batch["response_mask"]).sum(-1) / batch["response_mask"].sum(-1)
    sums = {}
    for uid, a in zip(batch["uid"], adv.tolist()):
        sums[uid] = sums.get(uid, 0.0) + a
    return np.array(list(sums.values()))


@pytest.fixture(scope="module")
def shared_groups(ray_cluster, tiny_model_dir, tmp_path_factory):
    """One set of worker groups (actor + rollout + ref) driven by every critic-free variant: their
    worker-side settings are the same, and starting processes is the slow part on 2 cores."""
    cfg = tiny_config(tiny_model_dir, tmp_path_factory.mktemp("runs"), "grpo", DIGITS, *KL)
    with build_trainer(cfg) as owner:
        yield owner.groups


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "reinforce_pp", "remax"])
def test_critic_free_variants(shared_groups, make_config, algorithm):
    trainer = build_trainer(make_config(algorithm, DIGITS, *KL), groups=shared_groups)
    assert "critic" not in trainer.groups
    batch, metrics = _step(trainer)
    _check_common(metrics)
    assert len(batch) == 4 * 2
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.001) and "actor/kl_loss" in metrics
    if algorithm in ("grpo", "rloo"):  # advantages are centred within each prompt's group
        np.testing.assert_allclose(_group_sums(batch), 0.0, atol=1e-5)
    if algorithm == "reinforce_pp":  # whitened over all valid tokens
        valid = batch["advantages"][batch["response_mask"].bool()]
        assert abs(float(valid.mean())) < 1e-5
    if algorithm == "remax":  # baseline = the greedy response's score, per prompt
        assert metrics["timing_s/gen_baseline"] > 0
        base = batch["reward_baselines"].view(-1, 2)
        assert torch.equal(base[:, 0], base[:, 1])
        mask = batch["response_mask"].float()
        to_go = (batch["token_level_rewards"] * mask).flip(-1).cumsum(-1).flip(-1)  # reward-to-go G_t
        expect = (to_go - batch["reward_baselines"][:, None]) * mask
        torch.testing.assert_close(batch["advantages"], expect, rtol=1e-4, atol=1e-5)
    history = trainer.fit()  # the second step through the public loop, with validation
    trainer.close()  # leaves the shared groups running
    assert history[-1]["step"] == 2
    assert "val/synthetic:arithmetic/acc@1" in history[-1] and "perf/throughput" in history[-1]
    assert empty_panels(history[-1]) == []  # every report panel finds what this run wrote
    assert panel_series(history[-1], dict(PANELS)["KL to reference"]) == [
        "actor/reward_kl_penalty",
        "actor/kl_loss",
    ]


def test_safe_rlhf_on_a_batch_not_dividing_dp(ray_cluster, make_config):
    """Safe-RLHF (two critics, rule cost, Lagrangian) with 3 prompts over dp=2: the controller pads,
    the workers drop the padding, and every row keeps its own numbers."""
    cfg = make_config(
        "safe_rlhf", DIGITS, COST, "algorithm.safe_rlhf.cost_limit=0.1", "algorithm.safe_rlhf.lambda_init=0.5",
        "algorithm.safe_rlhf.lambda_lr=0.2", "data.train_batch_size=3", "actor.ppo_mini_batch_size=3",
        "actor.ppo_epochs=2", "rollout.n=1", "algorithm.kl.in_reward=true", devices=2,
    )  # fmt: skip
    with build_trainer(cfg) as trainer:
        assert {"critic", "cost_critic"} <= set(trainer.groups)
        assert old_log_prob_source(trainer.cfg) == "actor"  # two epochs: recomputed by the actor group
        batch, metrics = _step(trainer)
        assert len(batch) == 3
        _check_common(metrics)
        for key in ("critic/vf_loss", "cost_critic/vf_loss", "critic/vf_explained_var", "timing_s/values"):
            assert math.isfinite(metrics[key])
        # the recomputed old log-probs are those of each row's own sampled tokens (not a neighbour's),
        # and at step 1 the reference still equals the actor
        mask = batch["response_mask"].bool()
        old = batch["old_log_probs"][mask]
        torch.testing.assert_close(old, batch["rollout_log_probs"][mask], atol=1e-4, rtol=0)
        torch.testing.assert_close(batch["ref_log_probs"][mask], old, atol=1e-5, rtol=0)
        cost = float(batch["costs"].mean())
        assert metrics["safe_rlhf/cost_mean"] == pytest.approx(cost)
        assert metrics["safe_rlhf/lambda"] == pytest.approx(max(0.0, 0.5 + 0.2 * (cost - 0.1)))
        assert {"cost_values", "cost_returns"} <= set(batch.keys())
        assert trainer.extra_state()["lagrange"] == pytest.approx(metrics["safe_rlhf/lambda"])
        # step 2, the actor has moved from the reference: PKU's KL split, the cost gains the beta * KL the
        # reward lost, and neither GAE is whitened
        batch, metrics = _step(trainer)
        mask = batch["response_mask"]
        penalty = batch["token_level_scores"] - batch["token_level_rewards"]
        assert float(penalty.abs().max()) > 0
        costs = place_score_on_last_token(batch["costs"].float(), mask)
        torch.testing.assert_close(batch["token_level_costs"], costs + penalty, atol=0, rtol=0)
        a = trainer.cfg.algorithm
        adv_r, _ = compute_gae(
            batch["token_level_rewards"], batch["values"], mask, a.gamma, a.lam, whiten=False
        )
        adv_c, _ = compute_gae(
            batch["token_level_costs"], batch["cost_values"], mask, a.gamma, a.lam, whiten=False
        )
        lmbda = metrics["safe_rlhf/lambda"]
        torch.testing.assert_close(batch["advantages"], (adv_r - lmbda * adv_c) / (1 + lmbda) * mask)
