"""The policy losses of `actor.policy_loss` (GSPO, CISPO, GMPO) against hand-computed values and gradients.

Two sequences: row 0 has two valid tokens (the third, padding, carries a huge log-ratio that must not
count), row 1 three. old log-probs -1 and -2; new = old + D."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import POLICY_LOSSES, policy_loss
from hybridflow.algorithms.policy_losses import cispo_loss, geo_mean_loss, gspo_loss

MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
OLD = torch.tensor([[-1.0] * 3, [-2.0] * 3])
D = torch.tensor([[0.1, -0.3, 5.0], [0.2, 0.0, -0.2]])


def _run(fn, adv_rows, *args, **kwargs):
    adv = torch.tensor(adv_rows).unsqueeze(-1).expand(2, 3).contiguous()
    log_probs = (OLD + D).requires_grad_(True)
    loss, metrics = fn(log_probs, OLD, adv, MASK, *args, **kwargs)
    loss.backward()
    return loss.item(), metrics, log_probs.grad


def test_registry_names_are_verls():
    assert POLICY_LOSSES == {"vanilla": policy_loss, "gspo": gspo_loss, "cispo": cispo_loss,
                             "geo_mean": geo_mean_loss}  # fmt: skip


def test_gspo_sequence_ratio_and_its_gradient():
    # row 0: s = exp(mean(0.1, -0.3)) = e^-0.1 inside [0.95, 1.05]? no: below, but A > 0 makes PPO's max
    # pick the unclipped -s; row 1: s = exp(mean(0.2, 0, -0.2)) = 1. seq-mean-token-mean over 2 sequences.
    loss, m, grad = _run(gspo_loss, [1.0, -2.0], 0.05, 0.05, None, "seq-mean-token-mean")
    s0 = math.exp(-0.1)
    assert loss == pytest.approx((-s0 + 2.0) / 2, abs=1e-6)
    assert m["clipfrac"].item() == 0.0
    # d/dlogp_t = -A s / (2 sequences * n_b tokens): every token of a sequence gets its sequence's ratio
    want = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=0)
    assert m["approx_kl"].item() == pytest.approx((-0.1 + 0.3 - 0.2 - 0.0 + 0.2) / 5, abs=1e-6)


def test_gspo_clips_the_sequence_ratio():
    # A < 0 on row 0: max(s, clip(s)) = 0.95, clipped, so row 0's tokens get no gradient (2 of 5 tokens)
    loss, m, grad = _run(gspo_loss, [-1.0, -2.0], 0.05, 0.05, None, "seq-mean-token-mean")
    assert loss == pytest.approx((0.95 + 2.0) / 2, abs=1e-6)
    assert m["clipfrac"].item() == pytest.approx(2 / 5)
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]), atol=1e-6, rtol=0
    )


def test_cispo_clipped_detached_weight_times_log_prob():
    # ratios e^0.1, e^-0.3 -> 0.8 (clipped), e^0.2 -> 1.2 (clipped), 1, e^-0.2; log-probs -0.9, -1.3 | -1.8, -2, -2.2
    loss, m, grad = _run(cispo_loss, [1.0, -2.0], 0.2, 0.2, None, "token-mean")
    w = [[math.exp(0.1), 0.8], [1.2, 1.0, math.exp(-0.2)]]
    per_token = [
        -1 * w[0][0] * -0.9,
        -1 * w[0][1] * -1.3,
        2 * w[1][0] * -1.8,
        2 * w[1][1] * -2.0,
        2 * w[1][2] * -2.2,
    ]
    assert loss == pytest.approx(sum(per_token) / 5, abs=1e-6)
    assert m["clipfrac"].item() == pytest.approx(2 / 5)
    # a clipped token keeps its gradient -A * w / 5 (PPO's clip would zero it)
    want = torch.tensor([[-w[0][0], -w[0][1], 0.0], [2 * w[1][0], 2 * w[1][1], 2 * w[1][2]]]) / 5
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=0)


def test_geo_mean_clips_in_log_space_by_the_sign_of_the_advantage():
    # clip 0.15 in log space. Row 0 (A = 1): the pessimistic min keeps 0.1 and -0.3 (clipping -0.3 to -0.15
    # would raise the objective): R0 = e^-0.1. Row 1 (A = -2): max(d, clip(d)) = 0.2, 0, -0.15:
    # R1 = e^(0.05 / 3). loss_b = -A_b R_b, averaged over the 2 sequences.
    loss, m, grad = _run(geo_mean_loss, [1.0, -2.0], 0.15, 0.15, None, "seq-mean-token-mean")
    r0, r1 = math.exp(-0.1), math.exp(0.05 / 3)
    assert loss == pytest.approx((-r0 + 2 * r1) / 2, abs=1e-6)
    assert m["clipfrac"].item() == pytest.approx(3 / 5)  # -0.3, 0.2 and -0.2 are outside [-0.15, 0.15]
    assert m["clipfrac_lower"].item() == pytest.approx(2 / 5)  # of them, on negative advantages
    # dR_b/dlogp_t = R_b / n_b where the unclipped log-ratio was kept, 0 where the clip was taken
    want = torch.tensor([[-r0 / 4, -r0 / 4, 0.0], [r1 / 3, r1 / 3, 0.0]])
    torch.testing.assert_close(grad, want, atol=1e-6, rtol=0)


def verl_geo_mean(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, weights):
    """verl 0.9.1's compute_policy_loss_geo_mean, written out: the sequence loss times the geometric
    mean of the sequence's rollout-correction weights, then a plain mean over the sequences."""
    neg_kl = log_prob - old_log_prob
    sgn = torch.sign(advantages)
    clamp = torch.clamp(neg_kl, -clip_low, clip_high)
    kl_min = sgn * torch.minimum(sgn * neg_kl, sgn * clamp)
    n = response_mask.sum(dim=-1)
    ratio = torch.exp((kl_min * response_mask).sum(dim=-1) / (n + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (n + 1e-8)
    seq_w = torch.exp((torch.log(weights + 1e-10) * response_mask).sum(dim=-1) / (n + 1e-8))
    return torch.mean(-advantage * ratio * seq_w)


def test_geo_mean_weighs_a_sequence_by_the_geometric_mean_of_its_weights_as_verl():
    gen = torch.Generator().manual_seed(0)
    B, L = 6, 9
    mask = (torch.arange(L) < torch.randint(2, L + 1, (B, 1), generator=gen)).float()
    old = -torch.rand(B, L, generator=gen) * 3
    log_probs = (old + 0.5 * torch.randn(B, L, generator=gen)).requires_grad_(True)
    adv = torch.randn(B, 1, generator=gen).expand(B, L)
    weights = torch.exp(torch.randn(B, L, generator=gen))  # far from uniform: the two means differ
    weights[0, 1] = 0.0  # a token the correction masks
    ours, _ = geo_mean_loss(log_probs, old, adv, mask, 0.4, 0.4, None, "seq-mean-token-mean", weights)
    theirs = verl_geo_mean(log_probs, old, adv, mask, 0.4, 0.4, weights)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    (g_ours,) = torch.autograd.grad(ours, log_probs)
    (g_theirs,) = torch.autograd.grad(theirs, log_probs)
    torch.testing.assert_close(g_ours, g_theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "geo_mean"])
def test_every_loss_is_weighted_by_is_weights_and_ignores_padding(name):
    fn = POLICY_LOSSES[name]
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    lp = OLD + D
    plain, _ = fn(lp, OLD, adv, MASK, 0.2, 0.2, 3.0, "token-mean")
    doubled, _ = fn(lp, OLD, adv, MASK, 0.2, 0.2, 3.0, "token-mean", torch.full((2, 3), 2.0))
    assert doubled.item() == pytest.approx(2 * plain.item(), rel=1e-6)
    junk = torch.where(MASK.bool(), lp, torch.full_like(lp, 50.0))  # padding values must not matter
    again, _ = fn(junk, OLD, adv, MASK, 0.2, 0.2, 3.0, "token-mean")
    assert again.item() == pytest.approx(plain.item(), rel=1e-6)
    assert math.isfinite(plain.item())
