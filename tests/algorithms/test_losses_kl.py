"""Policy / value losses, loss aggregation, KL estimators and controllers, Safe-RLHF, masked statistics."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    add_kl_to_costs,
    aggregate_loss,
    apply_kl_penalty,
    build_kl_controller,
    combine_reward_cost_advantages,
    compute_gae,
    compute_safe_rlhf_advantages,
    dpo_loss,
    entropy_from_logits,
    explained_variance,
    group_index,
    kl_loss,
    kl_penalty,
    log_probs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    place_score_on_last_token,
    policy_loss,
    update_lagrange_multiplier,
    value_loss,
)

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_aggregate_loss_modes_by_hand():
    loss = torch.tensor([[1.0, 3.0, 100.0], [5.0, 100.0, 100.0]])
    assert aggregate_loss(loss, MASK, "token-mean").item() == pytest.approx(3.0)  # (1+3+5)/3
    assert aggregate_loss(loss, MASK, "seq-mean-token-sum").item() == pytest.approx(4.5)  # (4+5)/2
    assert aggregate_loss(loss, MASK, "seq-mean-token-mean").item() == pytest.approx(3.5)  # (2+5)/2
    assert aggregate_loss(loss, MASK, "token-sum").item() == pytest.approx(9.0)  # 1+3+5
    # Dr. GRPO: each sequence's sum over the constant 8 (the configured response length, not the width 3)
    assert aggregate_loss(loss, MASK, "seq-mean-token-sum-norm", 8).item() == pytest.approx(
        (4 / 8 + 5 / 8) / 2
    )
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(loss, MASK, "seq-mean-token-sum-norm")
    empty_row = torch.cat([MASK, torch.zeros(1, 3)])
    loss3 = torch.cat([loss, torch.full((1, 3), 50.0)])
    assert aggregate_loss(loss3, empty_row, "seq-mean-token-mean").item() == pytest.approx(3.5)
    assert aggregate_loss(loss3, empty_row, "seq-mean-token-sum-norm", 4).item() == pytest.approx(9 / 8)
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(loss, MASK, "sum")


@pytest.mark.parametrize(
    "adv, log_ratio, expected_loss, clipped",
    [
        (1.0, math.log(1.5), -1.2, True),  # A > 0, r above 1 + 0.2: clipped to 1.2
        (1.0, math.log(0.5), -0.5, False),  # A > 0, r below 1 - 0.2: unclipped (pessimistic side)
        (-1.0, math.log(0.5), 0.8, True),  # A < 0, r below 1 - 0.2: clipped to 0.8
        (-1.0, math.log(1.5), 1.5, False),  # A < 0, r above: unclipped
        (2.0, 0.0, -2.0, False),  # on-policy
    ],
)
def test_policy_loss_clipping_cases(adv, log_ratio, expected_loss, clipped):
    old = torch.zeros(1, 1)
    logp = torch.full((1, 1), log_ratio, requires_grad=True)
    loss, metrics = policy_loss(logp, old, torch.full((1, 1), adv), torch.ones(1, 1), 0.2, 0.2)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["clipfrac"].item() == float(clipped)
    assert metrics["approx_kl"].item() == pytest.approx(-log_ratio, rel=1e-5, abs=1e-7)
    loss.backward()
    # A clipped token contributes no gradient; an unclipped one gives d(-A r)/d logp = -A r.
    expected_grad = 0.0 if clipped else -adv * math.exp(log_ratio)
    assert logp.grad.item() == pytest.approx(expected_grad, rel=1e-5)


def test_policy_loss_asymmetric_and_dual_clip_and_masking():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.25, 10.0, 99.0]]))
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    # clip_ratio_high 0.28 (DAPO): r = 1.25 is inside, unclipped -> -1.25. A < 0, r = 10: loss 10, dual clip caps at 3.
    loss, m = policy_loss(logp, old, adv, mask, 0.2, 0.28, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((-1.25 + 3.0) / 2, rel=1e-5)
    assert m["clipfrac_lower"].item() == pytest.approx(0.5)
    assert m["clipfrac"].item() == pytest.approx(0.0)
    loss_nodual, _ = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    assert loss_nodual.item() == pytest.approx((-1.25 + 10.0) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(logp, old, adv, mask, 0.2, 0.2, clip_ratio_c=0.5)


def test_value_loss_clipping_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 0.1, 7.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # token 0: unclipped (1-1)^2 = 0, clipped (0.5-1)^2 = 0.25 -> 0.25 (clip active)
    # token 1: unclipped 0.81, clipped V=0.1 within range -> 0.81 (not active)
    loss, m = value_loss(values, old, returns, mask, clip_range=0.5)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 0.81) / 2, rel=1e-5)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    loss_nc, m_nc = value_loss(values, old, returns, mask, clip_range=None)
    assert loss_nc.item() == pytest.approx(0.5 * 0.81 / 2, rel=1e-5)
    assert m_nc["vf_clipfrac"].item() == 0.0


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    d = math.log(2.0)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(d)
    assert kl_penalty(logp, ref, "mse").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + d)  # exp(-d) - 1 + d
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)
    assert kl_penalty(logp, torch.tensor([[-1e6]]), "k3").item() == 10.0  # clamped, finite
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(logp, ref, "k9")


def test_k1_and_k3_are_unbiased_estimates_of_true_kl():
    g = torch.Generator().manual_seed(0)
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    true_kl = (p * (p / q).log()).sum().item()
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, lq = p.log()[x][None], q.log()[x][None]
    assert kl_penalty(lp, lq, "k1").mean().item() == pytest.approx(true_kl, abs=0.01)
    assert kl_penalty(lp, lq, "k3").mean().item() == pytest.approx(true_kl, abs=0.01)


def test_apply_kl_penalty_and_kl_loss():
    scores = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    logp = torch.tensor([[0.1, 0.2, 5.0], [0.4, 5.0, 5.0]])
    ref = torch.zeros(2, 3)
    rewards, current_kl = apply_kl_penalty(scores, logp, ref, MASK, kl_coef=0.5, kind="k1")
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.9, 0.0], [1.8, 0.0, 0.0]]))
    assert current_kl.item() == pytest.approx((0.15 + 0.4) / 2)
    assert kl_loss(logp, ref, MASK, kind="k1").item() == pytest.approx(0.7 / 3)


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(100.0, 64)
    assert fixed.value == 0.1
    ctl = build_kl_controller("adaptive", 0.1, target_kl=1.0, horizon=100)
    ctl.update(3.0, 50)  # error clipped to +0.2: 0.1 * (1 + 0.2 * 0.5)
    assert ctl.value == pytest.approx(0.11)
    ctl.update(0.9, 100)  # error -0.1: 0.11 * 0.9
    assert ctl.value == pytest.approx(0.099)
    ctl.update(float("nan"), 100)
    assert ctl.value == pytest.approx(0.099)
    restored = AdaptiveKLController(1.0, 1.0, 1)
    restored.load_state_dict(ctl.state_dict())
    assert restored == ctl
    with pytest.raises(ValueError, match="target_kl"):
        build_kl_controller("adaptive", 0.1)


def test_safe_rlhf():
    assert update_lagrange_multiplier(0.5, mean_cost=2.0, cost_limit=1.0, lr=0.1) == pytest.approx(0.6)
    assert update_lagrange_multiplier(0.05, mean_cost=0.0, cost_limit=1.0, lr=0.1) == 0.0
    a_r, a_c = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])
    torch.testing.assert_close(combine_reward_cost_advantages(a_r, a_c, 1.0), torch.tensor([[-1.0, 1.5]]))
    torch.testing.assert_close(combine_reward_cost_advantages(a_r, a_c, 0.0), a_r)
    g = torch.Generator().manual_seed(1)
    r, v, c, vc = (torch.randn(2, 3, generator=g) for _ in range(4))
    adv, ret_r, ret_c = compute_safe_rlhf_advantages(r, v, c, vc, MASK, lmbda=0.5, gamma=1.0, lam=0.9)
    ar, rr = compute_gae(r, v, MASK, 1.0, 0.9, whiten=False)  # PKU whitens neither GAE
    ac, rc = compute_gae(c, vc, MASK, 1.0, 0.9, whiten=False)
    torch.testing.assert_close(adv, (ar - 0.5 * ac) / 1.5 * MASK)
    torch.testing.assert_close(ret_r, rr)
    torch.testing.assert_close(ret_c, rc)


def test_safe_rlhf_kl_penalty_survives_any_lambda():
    """PKU's split: reward - beta KL, cost + beta KL. Then the combined advantage is the constrained
    objective's plus exactly the KL penalty's own advantage, whatever lambda (by hand: values 0,
    gamma = lam = 1, so every advantage is the reward-to-go)."""
    score = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])  # on each last valid token
    cost = torch.tensor([[0.0, 3.0, 0.0], [-1.0, 0.0, 0.0]])
    penalty = torch.tensor([[0.1, 0.2, 0.0], [0.4, 0.0, 0.0]])  # beta * KL_t
    zeros = torch.zeros_like(score)
    torch.testing.assert_close(add_kl_to_costs(cost, penalty), cost + penalty)
    for lmbda in (0.0, 1.0, 3.0):
        adv, _, _ = compute_safe_rlhf_advantages(
            score - penalty, zeros, add_kl_to_costs(cost, penalty), zeros, MASK, lmbda, 1.0, 1.0
        )
        to_go = lambda x: x.flip(-1).cumsum(-1).flip(-1) * MASK  # noqa: E731
        expect = (to_go(score) - lmbda * to_go(cost)) / (1 + lmbda) - to_go(penalty)
        torch.testing.assert_close(adv, expect)


def test_masked_statistics():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, -9.0, -9.0]])
    assert masked_mean(x, MASK).item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(x, MASK, dim=-1), torch.tensor([1.5, 3.0]))
    assert masked_var(x, MASK).item() == pytest.approx(1.0)  # values 1,2,3 unbiased
    assert masked_var(x, MASK, unbiased=False).item() == pytest.approx(2 / 3)
    w = masked_whiten(x, MASK)
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-4, rtol=0)
    assert masked_mean(x, torch.zeros_like(MASK)).item() == 0.0


def test_entropy_and_log_probs_from_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(4.0), 0.0]))
    lp = log_probs_from_logits(torch.log(torch.tensor([[0.1, 0.2, 0.7]])), torch.tensor([2]))
    assert lp.item() == pytest.approx(math.log(0.7), rel=1e-5)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    assert explained_variance(returns, returns, MASK).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, MASK).item() == pytest.approx(0.0)
    assert explained_variance(returns, torch.ones_like(returns), MASK).item() == 0.0


def test_place_score_on_last_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = place_score_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.zeros(4, 4)
    expected[0, 1], expected[1, 3], expected[3, 2] = 1.0, 2.0, 4.0
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="scores"):
        place_score_on_last_token(torch.ones(3), mask)


def test_group_index_numbering():
    idx, n = group_index(["b", "a", "b", "c"])
    assert idx.tolist() == [0, 1, 0, 2] and n == 3
    idx, n = group_index(torch.tensor([5, 5, 2]))
    assert n == 2 and idx[0] == idx[1] != idx[2]


def test_dpo_loss_by_hand():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    # h = (pc - pr) - (rc - rr) = [2, -1]; beta = 0.5 -> beta h = [1, -0.5]
    loss, m = dpo_loss(pc, pr, rc, rr, beta=0.5)
    expected = (-math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(0.5)))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["reward_acc"].item() == 0.5
    torch.testing.assert_close(m["reward_margin"], torch.tensor(0.25))  # mean of beta h
    loss_ls, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=1.0)  # fully flipped labels
    expected_ls = (-math.log(1 / (1 + math.exp(1.0))) - math.log(1 / (1 + math.exp(-0.5)))) / 2
    assert loss_ls.item() == pytest.approx(expected_ls, rel=1e-5)
    mixed, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.2)  # cDPO: 0.8 x DPO + 0.2 x flipped
    assert mixed.item() == pytest.approx(0.8 * expected + 0.2 * expected_ls, rel=1e-5)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="hinge")[0].item() == pytest.approx((0 + 1.5) / 2)
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")[0].item() == pytest.approx((1 + 4) / 2)
    # reference_free ignores the reference log-probs: other references give the same loss.
    other_ref = torch.tensor([-9.0, 3.0])
    free, _ = dpo_loss(pc, pr, other_ref, rr, beta=0.5, reference_free=True)
    assert free.item() == pytest.approx(expected, rel=1e-5)
    assert dpo_loss(pc, pr, other_ref, rr, beta=0.5)[0].item() != pytest.approx(expected, rel=1e-3)
    with pytest.raises(ValueError, match="sigmoid"):
        dpo_loss(pc, pr, rc, rr, loss_type="kto")


def test_lagrange_multiplier_cap():
    assert update_lagrange_multiplier(9.0, mean_cost=5.0, cost_limit=0.0, lr=1.0, lambda_max=10.0) == 10.0
