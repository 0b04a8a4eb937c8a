"""Rollout correction (TIS, MIS, IcePop, geometric mask; token and sequence level) against hand values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import policy_loss, rollout_correction_weights

# rho = pi_old / mu per token: 0.5/0.25 = 2, 0.2/0.4 = 0.5, 0.9/0.1 = 9; row 1: 1, then padding (ratio 90)
OLD = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.9, 0.9]]))
MU = torch.log(torch.tensor([[0.25, 0.4, 0.1], [0.3, 0.01, 0.01]]))
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def _weights(mode, level="token", lower=0.0, upper=3.0):
    w, m = rollout_correction_weights(OLD, MU, MASK, mode, level, lower, upper)
    return w, {k: v.item() for k, v in m.items()}


def _valid(w):
    return [round(x, 5) for x in w[MASK.bool()].tolist()]


def test_token_tis_truncates_at_the_cap():
    w, m = _weights("tis")
    assert _valid(w) == [2.0, 0.5, 3.0, 1.0]
    # padding tokens (ratio 90, capped) count in no metric: (2 + 0.5 + 3 + 1) / 4, 1 of 4 capped
    assert m == pytest.approx({"is_weight_mean": 6.5 / 4, "is_weight_clipfrac": 0.25, "is_masked_frac": 0.0})
    assert not w.requires_grad


def test_sequence_tis_uses_the_product_of_the_token_ratios():
    w, m = _weights("tis", "sequence")  # row 0: 2 * 0.5 * 9 = 9 -> 3 on every token; row 1: 1
    assert _valid(w) == [3.0, 3.0, 3.0, 1.0]
    assert m["is_weight_mean"] == pytest.approx(2.5) and m["is_weight_clipfrac"] == pytest.approx(0.75)


def test_mis_masks_what_tis_would_truncate():
    w, m = _weights("mis")
    assert _valid(w) == [2.0, 0.5, 0.0, 1.0]
    assert m["is_masked_frac"] == pytest.approx(0.25) and m["is_weight_mean"] == pytest.approx(3.5 / 4)
    assert _valid(_weights("mis", "sequence", upper=10.0)[0]) == [9.0, 9.0, 9.0, 1.0]
    w, m = _weights("mis", "sequence", upper=5.0)
    assert _valid(w) == [0.0, 0.0, 0.0, 1.0] and m["is_masked_frac"] == pytest.approx(0.75)


def test_icepop_masks_both_sides_per_token():
    w, m = _weights("icepop", lower=0.6, upper=3.0)  # 0.5 below, 9 above
    assert _valid(w) == [2.0, 0.0, 0.0, 1.0] and m["is_masked_frac"] == pytest.approx(0.5)
    # icepop is per token whatever the level says of the others
    assert torch.equal(_weights("icepop", "sequence", 0.6, 3.0)[0], w)


def test_geo_mask_keeps_or_drops_whole_sequences_by_the_geometric_mean():
    # row 0's geometric mean: 9^(1/3) = 2.08; row 1's: 1
    w, m = _weights("geo_mask", lower=0.5, upper=2.0)
    assert _valid(w) == [0.0, 0.0, 0.0, 1.0] and m["is_masked_frac"] == pytest.approx(0.75)
    assert _valid(_weights("geo_mask", lower=0.5, upper=2.1)[0]) == [1.0, 1.0, 1.0, 1.0]
    assert _valid(_weights("geo_mask", lower=1.01, upper=2.1)[0]) == [1.0, 1.0, 1.0, 0.0]


def test_same_policy_gives_weight_one_and_huge_gaps_stay_finite():
    for mode, level in [("tis", "token"), ("mis", "sequence"), ("icepop", "token"), ("geo_mask", "token")]:
        w, m = rollout_correction_weights(OLD, OLD.clone(), MASK, mode, level, 0.5, 2.0)
        assert torch.equal(w[MASK.bool()], torch.ones(4)), mode
        assert m["is_weight_clipfrac"].item() == m["is_masked_frac"].item() == 0.0
    w, _ = rollout_correction_weights(torch.zeros(1, 1), torch.full((1, 1), -1e4), torch.ones(1, 1), "tis")
    assert w.item() == 2.0  # exp(1e4) would be inf: the log-ratio is clamped first
    assert rollout_correction_weights(OLD, MU, MASK, "none") == (None, {})
    with pytest.raises(ValueError, match="lower < upper"):
        rollout_correction_weights(OLD, MU, MASK, "mis", "token", 2.0, 1.0)
    with pytest.raises(ValueError, match="choose from"):
        rollout_correction_weights(OLD, MU, MASK, "seq_tis")


def test_policy_loss_multiplies_each_token_by_its_weight():
    adv = torch.tensor([[1.0, -2.0, 0.5], [1.0, 5.0, 5.0]])
    w, _ = rollout_correction_weights(OLD, MU, MASK, "tis", upper=3.0)
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
