"""The train-vs-rollout gap: how far the generation engine's log-probs of the sampled tokens are from the
training engine's log-probs of the same tokens (docs/metrics.md, "Train-vs-rollout gap").

Generation (KV-cached decode, fused kernels, vLLM) and training (a full forward, FSDP, autocast) compute
the same policy by different arithmetic; in bf16 the two round differently and the PPO ratio, taken
against one of them, is then biased. The gap says by how much, per step:

    rollout/log_prob_diff_mean  mean over response tokens of |log p_train - log p_rollout|
    rollout/log_prob_diff_max   max over response tokens
    rollout/probs_diff_mean / _max / _std   the same on probabilities, |p_train - p_rollout| (verl's
                                `training/rollout_probs_diff_*`)

Each dp rank holds some of the tokens, so a rank reduces its tokens to `GAP_STATS` (sums and maxes, not
means: means of ranks holding different token counts do not average to the global mean), the ranks'
vectors are reduced by `reduce_gap_stats` (sums add, maxes max), and `gap_metrics` divides at the end.
"""

from __future__ import annotations

import math

import torch

__all__ = ["GAP_STATS", "gap_metrics", "log_prob_gap_stats", "reduce_gap_stats"]

# one rank's (or micro-batch's) statistics, in this order: float64 (6,)
GAP_STATS = ("tokens", "abs_sum", "abs_max", "prob_abs_sum", "prob_sq_sum", "prob_abs_max")
_MAX = torch.tensor([name.endswith("_max") for name in GAP_STATS])


def log_prob_gap_stats(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """(B, L) training log-probs, rollout log-probs and mask of valid tokens -> (6,) float64 `GAP_STATS`,
    on the training log-probs' device.

    In float64, so that summing a long run of tiny differences adds no rounding of its own. Masked by
    `where`, not by indexing: no host sync per micro-batch on a GPU (indexing by a mask must read its
    count), and an invalid position's value, whatever it is, never reaches a sum. A batch with no valid
    token gives zeros (0 is the identity of the max, since every difference is >= 0)."""
    dev = train_log_probs.device
    mask = response_mask.to(dev).bool()
    if mask.numel() == 0:
        return torch.zeros(len(GAP_STATS), dtype=torch.float64, device=dev)
    train = train_log_probs.detach().double()
    rollout = rollout_log_probs.detach().to(dev).double()
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    diff = torch.where(mask, (train - rollout).abs(), zero)
    pdiff = torch.where(mask, (train.exp() - rollout.exp()).abs(), zero)
    tokens = mask.sum().double()
    return torch.stack([tokens, diff.sum(), diff.amax(), pdiff.sum(), pdiff.square().sum(), pdiff.amax()])


def reduce_gap_stats(stats: torch.Tensor) -> torch.Tensor:
    """(R, 6) `GAP_STATS` of R parts (dp ranks, micro-batches) -> (6,) of their union: token counts and
    sums add, maxes take the max."""
    stats = stats.to(torch.float64).reshape(-1, len(GAP_STATS))
    if len(stats) == 0:
        return torch.zeros(len(GAP_STATS), dtype=torch.float64, device=stats.device)
    return torch.where(_MAX.to(stats.device), stats.amax(0), stats.sum(0))


def gap_metrics(stats: torch.Tensor, prefix: str = "rollout/") -> dict[str, float]:
    """The metrics of one (6,) `GAP_STATS` vector (the whole step's, after reduce_gap_stats); empty when
    it holds no token. probs_diff_std is the sample std (n - 1), as torch.std in verl's."""
    s = dict(zip(GAP_STATS, stats.tolist()))
    n = s["tokens"]
    if n <= 0:
        return {}
    mean_p = s["prob_abs_sum"] / n
    var_p = max(s["prob_sq_sum"] - n * mean_p * mean_p, 0.0) / (n - 1) if n > 1 else 0.0
    return {
        f"{prefix}log_prob_diff_mean": s["abs_sum"] / n,
        f"{prefix}log_prob_diff_max": s["abs_max"],
        f"{prefix}probs_diff_mean": mean_p,
        f"{prefix}probs_diff_max": s["prob_abs_max"],
        f"{prefix}probs_diff_std": math.sqrt(var_p),
    }
