"""Truncated importance weights for a rollout one step behind the actor, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import policy_loss, truncated_is_weights

# pi_old / mu per token: 0.5/0.25 = 2, 0.2/0.4 = 0.5, 0.9/0.1 = 9 (capped at 3); row 2: 1, then padding
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.9, 0.9]]))
MU = torch.log(torch.tensor([[0.25, 0.4, 0.1], [0.3, 0.01, 0.01]]))
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_weights_are_the_ratio_truncated_at_the_cap():
    w, m = truncated_is_weights(OLD, MU, MASK, cap=3.0)
    assert torch.allclose(w[0], torch.tensor([2.0, 0.5, 3.0]), atol=1e-6)
    assert w[1, 0].item() == pytest.approx(1.0, abs=1e-6)
    # padding tokens (ratio 90, capped) count in neither metric: (2 + 0.5 + 3 + 1) / 4, 1 of 4 capped
    assert m["is_weight_mean"].item() == pytest.approx(6.5 / 4, abs=1e-6)
    assert m["is_weight_clipfrac"].item() == pytest.approx(0.25)
    assert not w.requires_grad


def test_same_policy_gives_weight_one_and_huge_gaps_stay_finite():
    w, m = truncated_is_weights(OLD, OLD.clone(), MASK, cap=2.0)
    assert torch.equal(w, torch.ones_like(w)) and m["is_weight_mean"].item() == 1.0
    assert m["is_weight_clipfrac"].item() == 0.0
    w, _ = truncated_is_weights(torch.zeros(1, 1), torch.full((1, 1), -1e4), torch.ones(1, 1), cap=2.0)
    assert w.item() == 2.0  # exp(1e4) would be inf: the log-ratio is clamped first
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(OLD, MU, MASK, cap=0.0)


def test_policy_loss_multiplies_each_token_by_its_weight():
    adv = torch.tensor([[1.0, -2.0, 0.5], [1.0, 5.0, 5.0]])
    w, _ = truncated_is_weights(OLD, MU, MASK, cap=3.0)
    log_probs = OLD.clone().requires_grad_(True)  # the actor has not moved yet: PPO ratio 1, no clip
    loss, _ = policy_loss(log_probs, OLD, adv, MASK, 0.2, 0.2, 3.0, "token-mean", is_weights=w)
    # per token -A * w: -1 * 2, 2 * 0.5, -0.5 * 3 and -1 * 1, token-mean over 4 tokens
    assert loss.item() == pytest.approx((-2.0 + 1.0 - 1.5 - 1.0) / 4, abs=1e-6)
    loss.backward()
    # d loss / d log_prob_t = -A_t * w_t * ratio_t / 4, ratio 1
    expected = torch.tensor([[-2.0, 1.0, -1.5], [-1.0, 0.0, 0.0]]) / 4
    assert torch.allclose(log_probs.grad, expected, atol=1e-6)
    plain, _ = policy_loss(OLD, OLD, adv, MASK, 0.2, 0.2, 3.0, "token-mean")
    ones, _ = policy_loss(OLD, OLD, adv, MASK, 0.2, 0.2, 3.0, "token-mean", is_weights=torch.ones(2, 3))
    assert ones.item() == plain.item() == pytest.approx((-1.0 + 2.0 - 0.5 - 1.0) / 4)
    assert math.isfinite(loss.item())
