"""Policy losses selected by `actor.policy_loss` (verl's `policy_loss.loss_mode` names), one pure function
each, all with one signature, in `POLICY_LOSSES`:

  vanilla   PPO's clipped token ratio with dual clip (losses.policy_loss)
  gspo      GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios,
            clipped; in its token form (GSPO-token), so each token's gradient is the sequence ratio times
            its own log-prob gradient
  cispo     CISPO (MiniMax-M1, 2025): the token ratio clipped and detached, times the token's log-prob:
            REINFORCE weighted by a truncated importance weight, so a clipped token still has a gradient
  geo_mean  GMPO (Zhao et al. 2025): per sequence, the geometric mean of the token ratios, each clipped in
            log space by the sign of the advantage (PPO's pessimistic min, taken per token)

Every function: log_probs (B, L) with grad; old_log_probs, advantages, response_mask (B, L); clip_ratio_low
and clip_ratio_high (their meaning per loss below), clip_ratio_c (dual clip, vanilla only), agg and
norm_length (losses.aggregate_loss), is_weights (B, L) or None (the rollout correction's weights,
multiplying each token's loss). Returns (loss, metrics): clipfrac (share of valid tokens whose clip is
active), clipfrac_lower (vanilla: the dual clip; geo_mean: the clip active on negative advantages;
else 0) and approx_kl (masked mean of old - new log-prob).

The sequence losses (gspo, geo_mean) place each sequence's loss on its tokens, so `agg` decides how the
sequences weigh: seq-mean-token-mean gives each the same weight, as both papers do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.algorithms.losses import aggregate_loss, policy_loss
from hybridflow.algorithms.rollout_correction import LOG_CLAMP
from hybridflow.algorithms.utils import masked_mean

__all__ = ["POLICY_LOSSES", "cispo_loss", "geo_mean_loss", "gspo_loss"]


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, 1): each row's mean over its valid tokens (0 for an empty row)."""
    return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)


def _ratio_metrics(clipped, log_ratio, mask, clipped_lower=None) -> dict[str, torch.Tensor]:
    """The policy-loss metrics every loss reports: the fraction of tokens clipped (and of those with a
    negative advantage; none where a loss has no separate lower clip) and the approximate KL."""
    lower = torch.zeros((), device=mask.device) if clipped_lower is None else masked_mean(clipped_lower, mask)
    return {"clipfrac": masked_mean(clipped, mask), "clipfrac_lower": lower,
            "approx_kl": masked_mean(-log_ratio, mask)}  # fmt: skip


def _finish(per_token, mask, agg, norm_length, is_weights, metrics):
    if is_weights is not None:
        per_token = per_token * is_weights
    return aggregate_loss(per_token, mask, agg, norm_length), {k: v.detach() for k, v in metrics.items()}


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    agg: str = "seq-mean-token-mean",
    is_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token. s_b = exp(mean_t(log_probs - old)) per sequence; token t's ratio is
    s_t = sg(s_b) * exp(log_probs_t - sg(log_probs_t)), equal to s_b in value, and
        loss_t = max(-A_t s_t, -A_t clip(s_t, 1 - clip_ratio_low, 1 + clip_ratio_high)).
    The clip range is around a sequence's geometric-mean ratio, which moves far less than a token's
    ratio: the paper's 3e-4 / 4e-4 (verl's GSPO recipe), not PPO's 0.2. clip_ratio_c is not used."""
    del clip_ratio_c
    mask = response_mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = _seq_mean(log_ratio, mask).detach()
    log_s = torch.clamp(log_probs - log_probs.detach() + seq_log_ratio, max=LOG_CLAMP)
    ratio = torch.exp(log_s)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    metrics = _ratio_metrics((loss_clipped > loss_unclipped).float(), log_ratio, mask)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    return _finish(per_token, mask, agg, norm_length, is_weights, metrics)


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO. r_t = exp(log_probs_t - old_t); loss_t = -A_t * sg(clip(r_t, 1 - low, 1 + high)) * log_probs_t.
    Unlike PPO's clip, which zeroes a clipped token's gradient, every token keeps its REINFORCE
    gradient, weighted by at most 1 + clip_ratio_high. clip_ratio_c is not used."""
    del clip_ratio_c
    mask = response_mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_CLAMP, LOG_CLAMP)).detach()
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    metrics = _ratio_metrics((clipped != ratio).float(), log_ratio, mask)
    per_token = -advantages * clipped * log_probs
    return _finish(per_token, mask, agg, norm_length, is_weights, metrics)


def geo_mean_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
    clip_ratio_c: float | None = None,
    agg: str = "seq-mean-token-mean",
    is_weights: torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO. With d_t = log_probs_t - old_t and sign a = sign(A_t), each token's log-ratio is clipped
    pessimistically in log space, d'_t = a * min(a d_t, a clip(d_t, -clip_ratio_low, clip_ratio_high)),
    so the bounds are on the log-ratio (the paper's (e^-0.4, e^0.4) is clip_ratio 0.4 both sides);
    then per sequence R_b = exp(mean_t d'_t), A_b = mean_t A_t and loss_b = -A_b R_b, placed on each
    valid token of b. is_weights weigh a sequence as verl's geo_mean does: by their geometric mean over
    its valid tokens, w_b = exp(mean_t log w_t), as the ratio is one; their arithmetic mean would give a
    sequence with one outlying token a larger weight than verl. clip_ratio_c is not used."""
    del clip_ratio_c
    mask = response_mask.to(log_probs.dtype)
    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_CLAMP, LOG_CLAMP)
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = torch.exp(_seq_mean(pessimistic, mask))  # (B, 1)
    per_token = (-_seq_mean(advantages, mask) * seq_ratio).expand_as(log_probs)
    if is_weights is not None:  # 1e-10: verl's guard for a weight of 0 (a token the correction masks)
        per_token = per_token * torch.exp(_seq_mean(torch.log(is_weights + 1e-10), mask))
    active = (clamped != log_ratio).float()
    metrics = _ratio_metrics(active, log_probs - old_log_probs, mask, active * (advantages < 0))
    return _finish(per_token, mask, agg, norm_length, None, metrics)


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": policy_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "geo_mean": geo_mean_loss,
}
