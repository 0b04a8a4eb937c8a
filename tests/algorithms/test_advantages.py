"""Advantage estimators against plain Python loops and hand-computed numbers, including padded masks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    compute_discounted_returns,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
)


def _gae_reference(rewards, values, mask, gamma, lam):
    """cleanrl-style loop over each sequence's valid tokens only (padding removed first)."""
    B, L = len(rewards), len(rewards[0])
    adv = [[0.0] * L for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(L) if mask[b][t]]
        last_gae, next_value = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last_gae = delta + gamma * lam * last_gae
            adv[b][t] = last_gae
            next_value = values[b][t]
    rets = [[(adv[b][t] + values[b][t]) if mask[b][t] else 0.0 for t in range(L)] for b in range(B)]
    return torch.tensor(adv), torch.tensor(rets)


def _random_case(seed=0, B=4, L=7, holes=False):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, L, generator=g)
    values = torch.randn(B, L, generator=g)
    lengths = torch.tensor([L, 1, 4, 0])[:B]
    mask = (torch.arange(L)[None, :] < lengths[:, None]).float()
    if holes:  # a multi-turn response: tool-output tokens in the middle are not the policy's
        mask[0, 2:4] = 0
    # Padding carries garbage that must not leak into valid positions.
    rewards = torch.where(mask.bool(), rewards, torch.full_like(rewards, 99.0))
    values = torch.where(mask.bool(), values, torch.full_like(values, -77.0))
    return rewards, values, mask


@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_reference_loop(holes):
    rewards, values, mask = _random_case(holes=holes)
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    ref_adv, ref_ret = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.9, 0.8)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()


def test_gae_hand_computed_two_tokens():
    # r = [0, 1], V = [0.5, 0.2], gamma = lam = 1: A_1 = 1 - 0.2 = 0.8; A_0 = 0 + 0.2 - 0.5 + 0.8 = 0.5.
    adv, ret = compute_gae(torch.tensor([[0.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.2, 3.0]]),
                           torch.tensor([[1, 1, 0]]), gamma=1.0, lam=1.0, whiten=False)  # fmt: skip
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))


def test_gae_whitened_has_zero_mean_unit_var_on_valid_tokens():
    rewards, values, mask = _random_case(seed=3)
    adv, _ = compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
    valid = adv[mask.bool()]
    assert abs(valid.mean().item()) < 1e-5
    assert abs(valid.std().item() - 1.0) < 1e-4
    assert (adv[mask == 0] == 0).all()


def test_grpo_hand_computed_with_string_uids_and_padding():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 3.0])
    uids = np.array(["a", "a", "b", "b", "c"], dtype=object)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    adv, ret = compute_grpo_advantages(scores, uids, mask)
    # Group a = [1, 0]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.7071 = +-0.7071. Group c has one sample -> 0.
    a = 0.5 / np.sqrt(0.5)
    expected = torch.tensor([[a, a, 0], [-a, 0, 0], [a, a, a], [-a, 0, 0], [0, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, adv)


def test_grpo_tensor_ids_token_level_scores_and_dr_grpo():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    token_scores = torch.zeros(3, 3)
    token_scores[0, 1], token_scores[1, 2], token_scores[2, 0] = 2.0, 4.0, 9.0
    token_scores[0, 2] = 100.0  # padding: must be ignored when summing
    adv, _ = compute_grpo_advantages(token_scores, torch.tensor([7, 7, 8]), mask, norm_by_std=False)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.0, 1.0, 0.0]))
    assert (adv[mask == 0] == 0).all()


def test_grpo_all_singletons_and_identical_scores_give_zero():
    mask = torch.ones(3, 2)
    adv, _ = compute_grpo_advantages(torch.tensor([1.0, 2.0, 3.0]), ["x", "y", "z"], mask)
    assert (adv == 0).all()
    adv, _ = compute_grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), ["x", "x", "x"], mask)
    assert (adv == 0).all()


def test_grpo_rejects_mismatched_group_ids():
    with pytest.raises(ValueError, match="group_ids"):
        compute_grpo_advantages(torch.ones(3), ["a", "b"], torch.ones(3, 2))


def test_rloo_matches_leave_one_out_loop():
    scores = [3.0, 1.0, 2.0, 5.0, -1.0, 7.0]
    uids = np.array(["p", "p", "p", "q", "q", "r"], dtype=object)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [1, 1]])
    adv, _ = compute_rloo_advantages(torch.tensor(scores), uids, mask)
    for i, (s, u) in enumerate(zip(scores, uids)):
        others = [scores[j] for j in range(len(scores)) if uids[j] == u and j != i]
        expected = s - sum(others) / len(others) if others else 0.0
        torch.testing.assert_close(adv[i], torch.tensor(expected) * mask[i].float())


def test_remax_sequence_and_token_level():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = compute_remax_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.25, 0.5]), mask)
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.0], [-0.5, -0.5, -0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # Token-level: reward-to-go per token, KL-shaped rewards of -0.1 on each token plus the score at the end.
    tok = torch.tensor([[-0.1, 0.9, 5.0], [-0.1, -0.1, -0.1]])
    adv, ret = compute_remax_advantages(tok, torch.tensor([0.0, 0.0]), mask)
    torch.testing.assert_close(ret, torch.tensor([[0.8, 0.9, 0.0], [-0.3, -0.2, -0.1]]))
    torch.testing.assert_close(adv, ret)


def test_discounted_returns_and_reinforce_pp():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 8.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ret = compute_discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]]))
    adv, ret2 = compute_reinforce_pp_advantages(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret2, ret)
    valid = torch.tensor([0.25, 0.5, 1.0, 0.5, 0.0])
    torch.testing.assert_close(adv[mask.bool()], (valid - valid.mean()) / valid.std(), atol=1e-5, rtol=1e-4)
    assert (adv[mask == 0] == 0).all()
