"""The train-vs-rollout gap's pure functions: per-part statistics and their reduction over dp ranks."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.rollout_correction import (
    GAP_STATS,
    gap_metrics,
    log_prob_gap_stats,
    reduce_gap_stats,
)


def _stats(train, rollout, mask):
    f64 = torch.float64  # exact decimal-ish inputs, so the sums are checked to float64 rounding
    return log_prob_gap_stats(
        torch.tensor(train, dtype=f64), torch.tensor(rollout, dtype=f64), torch.tensor(mask)
    )


def test_stats_of_one_part_by_hand():
    # row 0: diffs 0.5, 0.25 (the third token is padding: its huge diff must not count); row 1: 0.0
    train = [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]]
    rollout = [[-1.5, -1.75, -9.0], [-0.5, 0.0, 0.0]]
    s = dict(zip(GAP_STATS, _stats(train, rollout, [[1, 1, 0], [1, 0, 0]]).tolist()))
    assert s["tokens"] == 3
    assert s["abs_sum"] == pytest.approx(0.75, abs=1e-12) and s["abs_max"] == pytest.approx(0.5, abs=1e-12)
    p = [abs(math.exp(-1.0) - math.exp(-1.5)), abs(math.exp(-2.0) - math.exp(-1.75)), 0.0]
    assert s["prob_abs_sum"] == pytest.approx(sum(p), abs=1e-12)
    assert s["prob_sq_sum"] == pytest.approx(sum(x * x for x in p), abs=1e-12)
    assert s["prob_abs_max"] == pytest.approx(max(p), abs=1e-12)
    m = gap_metrics(_stats(train, rollout, [[1, 1, 0], [1, 0, 0]]))
    assert m["rollout/log_prob_diff_mean"] == pytest.approx(0.25, abs=1e-12)
    assert m["rollout/log_prob_diff_max"] == pytest.approx(0.5, abs=1e-12)
    assert m["rollout/probs_diff_std"] == pytest.approx(
        float(torch.tensor(p, dtype=torch.float64).std()), abs=1e-12
    )


def test_two_dp_ranks_reduce_to_the_token_weighted_mean_and_the_max():
    """Rank 0 holds 3 tokens with diffs 0.1, 0.2, 0.3, rank 1 one token with diff 1.0: the step's mean is
    1.6 / 4 = 0.4 (the mean of the ranks' means, 0.6, would weigh rank 1's token three times too much),
    its max 1.0 (a mean of the ranks' maxes would give 0.65)."""
    rank0 = _stats([[0.1, 0.2, 0.3]], [[0.0, 0.0, 0.0]], [[1, 1, 1]])
    rank1 = _stats([[1.0, 7.0, 7.0]], [[0.0, 0.0, 0.0]], [[1, 0, 0]])
    both = reduce_gap_stats(torch.stack([rank0, rank1]))
    m = gap_metrics(both)
    assert m["rollout/log_prob_diff_mean"] == pytest.approx(0.4, abs=1e-12)
    assert m["rollout/log_prob_diff_max"] == pytest.approx(1.0, abs=1e-12)
    # the union of the parts gives what the whole batch gives, whichever order the ranks come in
    whole = _stats([[0.1, 0.2, 0.3], [1.0, 7.0, 7.0]], [[0.0] * 3] * 2, [[1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(both, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reduce_gap_stats(torch.stack([rank1, rank0])), whole, rtol=1e-12, atol=1e-12)


def test_a_rank_without_tokens_changes_nothing():
    """A dp rank whose rows are all padding (a batch not dividing dp) adds zeros: 0 is the max's identity
    (every difference is >= 0), and a step with no token at all logs nothing rather than 0/0."""
    rank0 = _stats([[-1.0, -3.0]], [[-1.25, -2.0]], [[1, 1]])
    empty = _stats([[-1.0, -3.0]], [[-9.0, -9.0]], [[0, 0]])
    assert empty.tolist() == [0.0] * len(GAP_STATS)
    torch.testing.assert_close(reduce_gap_stats(torch.stack([rank0, empty])), rank0)
    assert gap_metrics(reduce_gap_stats(torch.zeros(0))) == {}
    assert gap_metrics(empty) == {}


def test_stats_follow_the_training_device_without_reading_values():
    """On a GPU the training log-probs are on the device while the micro-batch's rollout log-probs and
    mask may still be on the host, and a value read per micro-batch would be a host sync. Strict CPU
    stand-in: training log-probs on the meta device, which holds no values, so any read (`.item()`,
    indexing by a mask, `.cpu()`) raises; the statistics and their reduction must stay on it."""
    train = torch.zeros(2, 3, device="meta")
    stats = log_prob_gap_stats(train, torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.long))
    assert stats.device.type == "meta" and stats.shape == (len(GAP_STATS),)
    assert reduce_gap_stats(torch.stack([stats, stats])).device.type == "meta"


def test_rollout_corr_metrics_by_hand():
    """verl's rollout_corr/* on the first test's tokens: log rho = train - rollout = 0.5, -0.25 (row 0) and 0
    (row 1); the padding token's log-ratio of 9 must count nowhere."""
    train = [[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]]
    rollout = [[-1.5, -1.75, -9.0], [-0.5, 0.0, 0.0]]
    m = gap_metrics(_stats(train, rollout, [[1, 1, 0], [1, 0, 0]]))
    e = math.exp
    rho = [e(0.5), e(-0.25), 1.0]
    want = {
        "rollout_corr/kl": -(0.5 - 0.25) / 3,  # mean of log mu - log pi
        "rollout_corr/k3_kl": sum(r - 1 - math.log(r) for r in rho) / 3,
        "rollout_corr/training_ppl": (e(1.5) + e(0.5)) / 2,  # row means of log p: -1.5 and -0.5
        "rollout_corr/rollout_ppl": (e(1.625) + e(0.5)) / 2,
        "rollout_corr/ppl_ratio": (e(-0.125) + 1.0) / 2,
        "rollout_corr/chi2_token": sum(r * r for r in rho) / 3 - 1,
        "rollout_corr/chi2_seq": (e(2 * 0.25) + 1.0) / 2 - 1,  # row 0's product of ratios: e^0.25
        "rollout_corr/rollout_is_eff_sample_size": sum(rho) ** 2 / (3 * sum(r * r for r in rho)),
    }
    assert {k: m[k] for k in want} == pytest.approx(want, abs=1e-12)


def test_rollout_corr_metrics_reduce_over_ranks_not_as_means_of_ranks():
    """Rank 0: two tokens with rho = 1, rank 1: one with rho = 4. ESS of the step (1 + 1 + 4)^2 / (3 * 18)
    = 2/3, chi2_token (1 + 1 + 16) / 3 - 1 = 5; the mean of the ranks' values would be 1 and 7.5; chi2_seq
    over the 2 sequences: (1 + 16) / 2 - 1 = 7.5, k1 -log 4 / 3."""
    rank0 = _stats([[-1.0, -1.0]], [[-1.0, -1.0]], [[1, 1]])
    rank1 = _stats([[-1.0, -1.0]], [[-1.0 - math.log(4), 0.0]], [[1, 0]])
    m = gap_metrics(reduce_gap_stats(torch.stack([rank0, rank1])))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(2 / 3, abs=1e-12)
    assert m["rollout_corr/chi2_token"] == pytest.approx(5.0, abs=1e-12)
    assert m["rollout_corr/chi2_seq"] == pytest.approx(7.5, abs=1e-12)
    assert m["rollout_corr/kl"] == pytest.approx(-math.log(4) / 3, abs=1e-12)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx((1 + 0.25) / 2, abs=1e-12)
