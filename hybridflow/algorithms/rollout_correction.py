"""Rollout correction: importance weights for the gap between the policy that sampled the tokens (the
rollout, mu) and the policy the PPO ratio is taken against (pi_old, the training engine's log-probs before
the update), applied to each token's policy loss (`actor.rollout_correction`; docs/metrics.md).

The two differ when the rollout's numerics are not the training forward's (bf16, vLLM's kernels) and when
the rollout runs one step behind (trainer.rollout_ahead=1: mu is the previous step's weights). With the
ratio rho = pi_old / mu, per token (level "token") or per sequence (level "sequence", the product over
the sequence's tokens: exp(sum_t log rho_t)):

  tis       w = min(rho, upper)                      truncated IS (Espeholt et al. 2018; Yao et al. 2025)
  mis       w = rho if lower <= rho <= upper else 0  masked IS: a token / sequence too far off is dropped
  icepop    mis at token level with both bounds      IcePop (Ling team 2025; its bounds 0.5, 5)
  geo_mask  w = 1 if lower <= exp(mean_t log rho_t) <= upper else 0, per sequence: a mask only, on the
            geometric mean of the token ratios (length-independent; verl's "geometric" rejection)

Weights are data (no gradient): they reweigh the loss, they are not part of the policy.

The same gap is also measured (the train-vs-rollout gap): how far the generation engine's log-probs of the
sampled tokens are from the training engine's log-probs of the same tokens (docs/metrics.md, "Train-vs-rollout gap").

Generation (KV-cached decode, fused kernels, vLLM) and training (a full forward, FSDP, autocast) compute
the same policy by different arithmetic; in bf16 the two round differently and the PPO ratio, taken
against one of them, is then biased. The gap says by how much, per step:

    rollout/log_prob_diff_mean  mean over response tokens of |log p_train - log p_rollout|
    rollout/log_prob_diff_max   max over response tokens
    rollout/probs_diff_mean / _max / _std   the same on probabilities, |p_train - p_rollout| (verl's
                                `training/rollout_probs_diff_*`)

and, with rho_t = p_train / p_rollout of each token (verl's `rollout_corr/*` names):

    rollout_corr/kl             k1 estimate of KL(rollout || train): mean_t (log p_rollout - log p_train)
    rollout_corr/k3_kl          k3 estimate of the same: mean_t (rho_t - 1 - log rho_t), >= 0 term by term
    rollout_corr/training_ppl, rollout_corr/rollout_ppl   mean over sequences of exp(-mean_t log p)
    rollout_corr/ppl_ratio      mean over sequences of training ppl / rollout ppl
    rollout_corr/chi2_token     chi-square divergence per token, mean_t rho_t^2 - 1
    rollout_corr/chi2_seq       the same per sequence on rho_b = prod_t rho_t: mean_b rho_b^2 - 1
    rollout_corr/rollout_is_eff_sample_size   (sum_t rho_t)^2 / (n sum_t rho_t^2), in (0, 1]: 1 when every
                                token's ratio is equal; the share of the tokens importance weights leave

Each dp rank holds some of the tokens, so a rank reduces its tokens to `GAP_STATS` (sums and maxes, not
means: means of ranks holding different token counts do not average to the global mean), the ranks'
vectors are reduced by `reduce_gap_stats` (sums add, maxes max), and `gap_metrics` divides at the end.
"""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.utils import masked_mean

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "GAP_STATS",
    "gap_metrics",
    "log_prob_gap_stats",
    "reduce_gap_stats",
    "rollout_correction_weights",
]

CORRECTION_MODES = ("none", "tis", "mis", "icepop", "geo_mask")
CORRECTION_LEVELS = ("token", "sequence")
# log-ratios clamped before exp: a token mu found far less likely must not give inf (float64 holds
# exp(2 * 20), the gap's squared ratios, with room to spare)
LOG_CLAMP = 20.0


def _log_rho(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(B, L) log-ratio per token, or each sequence's summed log-ratio broadcast over its tokens."""
    log_rho = (old - rollout) * mask
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(old)
    return torch.clamp(log_rho, -LOG_CLAMP, LOG_CLAMP)


def rollout_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str,
    level: str = "token",
    lower: float = 0.0,
    upper: float = 2.0,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Per-token weights (B, L) for the policy loss, or None for mode "none"; inputs (B, L).

    Metrics (0-d, over valid tokens): is_weight_mean (masked mean of the weights), is_weight_clipfrac
    (share of tokens whose weight tis truncated) and is_masked_frac (share of tokens whose weight a mask
    set to 0: a masked sequence counts all its tokens). Empty for mode "none"."""
    if mode not in CORRECTION_MODES or level not in CORRECTION_LEVELS:
        raise ValueError(f"rollout correction mode {mode!r} / level {level!r}: choose from "
                         f"{CORRECTION_MODES} / {CORRECTION_LEVELS}")  # fmt: skip
    if mode == "none":
        return None, {}
    if not 0.0 <= lower < upper:
        raise ValueError(
            f"rollout correction bounds need 0 <= lower < upper, got lower={lower}, upper={upper}"
        )
    mask = response_mask.to(old_log_probs.dtype)
    old, rollout = old_log_probs.detach(), rollout_log_probs.detach().to(old_log_probs.device)
    zeros = torch.zeros_like(old)
    if mode == "geo_mask":
        geo = torch.exp(
            ((old - rollout) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        )
        keep = ((geo >= lower) & (geo <= upper)).expand_as(old)
        weights, clipped = keep.to(old.dtype), zeros
    else:
        rho = torch.exp(_log_rho(old, rollout, mask, "token" if mode == "icepop" else level))
        if mode == "tis":
            weights, clipped = torch.clamp(rho, max=upper), (rho > upper).to(old.dtype)
        else:  # mis, icepop
            keep = (rho >= lower) & (rho <= upper)
            weights, clipped = torch.where(keep, rho, zeros), zeros
    metrics = {
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_clipfrac": masked_mean(clipped, mask),
        "is_masked_frac": masked_mean((weights == 0).to(old.dtype), mask),
    }
    return weights, metrics


# ---- the train-vs-rollout gap: statistics per rank, reduced over dp ranks ----
# one rank's (or micro-batch's) statistics, in this order: float64 (15,). Per token: the first 10; per
# sequence with a valid token: the last 5.
GAP_STATS = (
    "tokens", "abs_sum", "abs_max", "prob_abs_sum", "prob_sq_sum", "prob_abs_max",
    "k1_sum", "k3_sum", "rho_sum", "rho_sq_sum",
    "seqs", "train_ppl_sum", "rollout_ppl_sum", "ppl_ratio_sum", "rho_seq_sq_sum",
)  # fmt: skip
_MAX = torch.tensor([name.endswith("_max") for name in GAP_STATS])


def log_prob_gap_stats(
    train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """(B, L) training log-probs, rollout log-probs and mask of valid tokens -> (15,) float64 `GAP_STATS`,
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

    def masked(x):
        return torch.where(mask, x, zero)

    log_rho = masked((train - rollout).clamp(-LOG_CLAMP, LOG_CLAMP))
    diff, pdiff, rho = (
        masked((train - rollout).abs()),
        masked((train.exp() - rollout.exp()).abs()),
        masked(log_rho.exp()),
    )
    token_stats = [mask.sum().double(), diff.sum(), diff.amax(), pdiff.sum(), pdiff.square().sum(),
                   pdiff.amax(), -log_rho.sum(), masked(rho - 1 - log_rho).sum(), rho.sum(), rho.square().sum()]  # fmt: skip
    return torch.stack(token_stats + _sequence_stats(masked(train), masked(rollout), log_rho, mask))


def _sequence_stats(train, rollout, log_rho, mask) -> list[torch.Tensor]:
    """The per-sequence sums of GAP_STATS (inputs already zero off the mask); empty rows excluded."""
    n = mask.sum(-1).double()
    valid = n > 0
    n = n.clamp(min=1)
    zero = torch.zeros((), dtype=torch.float64, device=train.device)
    mean_train, mean_rollout = train.sum(-1) / n, rollout.sum(-1) / n

    def total(x):
        return torch.where(valid, x, zero).sum()

    seq_log_rho = log_rho.sum(-1).clamp(-LOG_CLAMP, LOG_CLAMP)
    return [valid.sum().double(), total((-mean_train).exp()), total((-mean_rollout).exp()),
            total((mean_rollout - mean_train).exp()), total((2 * seq_log_rho).exp())]  # fmt: skip


def reduce_gap_stats(stats: torch.Tensor) -> torch.Tensor:
    """(R, 15) `GAP_STATS` of R parts (dp ranks, micro-batches) -> (15,) of their union: token counts and
    sums add, maxes take the max."""
    stats = stats.to(torch.float64).reshape(-1, len(GAP_STATS))
    if len(stats) == 0:
        return torch.zeros(len(GAP_STATS), dtype=torch.float64, device=stats.device)
    return torch.where(_MAX.to(stats.device), stats.amax(0), stats.sum(0))


def gap_metrics(stats: torch.Tensor, prefix: str = "rollout/") -> dict[str, float]:
    """The metrics of one `GAP_STATS` vector (the whole step's, after reduce_gap_stats); empty when it
    holds no token. probs_diff_std is the sample std (n - 1), as torch.std in verl's."""
    s = dict(zip(GAP_STATS, stats.tolist()))
    n, seqs = s["tokens"], s["seqs"]
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
        "rollout_corr/kl": s["k1_sum"] / n,
        "rollout_corr/k3_kl": s["k3_sum"] / n,
        "rollout_corr/training_ppl": s["train_ppl_sum"] / seqs,
        "rollout_corr/rollout_ppl": s["rollout_ppl_sum"] / seqs,
        "rollout_corr/ppl_ratio": s["ppl_ratio_sum"] / seqs,
        "rollout_corr/chi2_token": s["rho_sq_sum"] / n - 1.0,
        "rollout_corr/chi2_seq": s["rho_seq_sq_sum"] / seqs - 1.0,
        "rollout_corr/rollout_is_eff_sample_size": s["rho_sum"] ** 2 / (n * s["rho_sq_sum"]),
    }
