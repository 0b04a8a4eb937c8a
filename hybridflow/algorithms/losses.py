"""Training losses: PPO clipped policy loss (with dual clip), clipped value loss, and loss aggregation.

The worker owns the mini-batch / epoch loop and the backward pass; these functions only turn per-token
tensors into a scalar loss plus detached metrics. Metrics are 0-d tensors (no `.item()` here: that
would force a device sync per micro-batch; the worker converts once per step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.algorithms.utils import masked_mean

__all__ = ["AGG_MODES", "DPO_LOSS_TYPES", "aggregate_loss", "policy_loss", "value_loss", "dpo_loss"]

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm_length: int | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (B, L) to a scalar over the valid tokens given by mask (B, L).

    token-mean              : sum(loss * mask) / sum(mask)     every token weighs the same (DAPO)
    token-sum               : sum(loss * mask)                 no normaliser at all (grows with the batch)
    seq-mean-token-sum      : mean_b sum_t(loss * mask)        no length normalisation
    seq-mean-token-mean     : mean_b [sum_t(loss*mask) / n_b]  original GRPO, every sequence weighs the same
    seq-mean-token-sum-norm : mean_b [sum_t(loss*mask) / norm_length]  Dr. GRPO's constant normaliser
    Sequences with an empty mask are excluded from the seq-mean modes. norm_length (the configured
    maximum response length) is used by seq-mean-token-sum-norm only, and required there: not the
    tensor's width, which the engine trims to each micro-batch's longest response.
    """
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        return masked_mean(per_token, mask)
    if mode == "token-sum":
        return (per_token * mask).sum()
    seq_tokens = mask.sum(dim=-1)
    valid_seqs = (seq_tokens > 0).to(per_token.dtype)
    seq_sum = (per_token * mask).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs norm_length > 0, got {norm_length}")
        per_seq = seq_sum / norm_length
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")
    return (per_seq * valid_seqs).sum() / valid_seqs.sum().clamp(min=1)


def policy_loss(
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
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip (DAPO) and optional dual clip.

    log_probs (B, L) current policy (carries grad); old_log_probs, advantages, response_mask: (B, L).
        r = exp(log_probs - old_log_probs)
        loss_t = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    Dual clip (Ye et al. 2020), when clip_ratio_c (> 1) is given: for A < 0 the loss is also capped at
    -A * clip_ratio_c, so one very off-policy token cannot dominate.
    is_weights (B, L), when given, multiply each token's loss after the clips (the rollout correction's
    weights: algorithms/rollout_correction.py). norm_length: aggregate_loss's.
    Returns (loss, metrics) with metrics: clipfrac (share of tokens where the clip is active),
    clipfrac_lower (dual clip active), approx_kl (mean of old_log_probs - log_probs, k1).
    """
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(
            f"clip_ratio_c must be > 1 for dual clip (got {clip_ratio_c}); use None to disable it"
        )
    mask = response_mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    # Clamp before exp: a stale sample with a huge log-ratio would otherwise overflow to inf.
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
    }
    if clip_ratio_c is not None:
        loss_dual = -advantages * clip_ratio_c
        dual = torch.minimum(per_token, loss_dual)
        lower_active = (advantages < 0) & (per_token > loss_dual)
        per_token = torch.where(advantages < 0, dual, per_token)
        metrics["clipfrac_lower"] = masked_mean(lower_active.float(), mask).detach()
    else:
        metrics["clipfrac_lower"] = torch.zeros((), device=log_probs.device)
    if is_weights is not None:
        per_token = per_token * is_weights
    return aggregate_loss(per_token, mask, agg, norm_length), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float | None = 0.5,
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

    values (B, L) current critic output (carries grad); old_values, returns, response_mask: (B, L).
    clip_range=None disables clipping; norm_length: aggregate_loss's. Returns (loss, metrics) with metrics: vf_clipfrac (share of
    tokens where the clipped term is the larger one), vpred_mean.
    """
    mask = response_mask.to(values.dtype)
    loss_unclipped = (values - returns) ** 2
    if clip_range is None:
        per_token, clipfrac = loss_unclipped, torch.zeros((), device=values.device)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        loss_clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), mask)
    metrics = {"vf_clipfrac": clipfrac.detach(), "vpred_mean": masked_mean(values, mask).detach()}
    return 0.5 * aggregate_loss(per_token, mask, agg, norm_length), metrics


def dpo_loss(
    chosen_log_probs: torch.Tensor,
    rejected_log_probs: torch.Tensor,
    ref_chosen_log_probs: torch.Tensor,
    ref_rejected_log_probs: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO (Rafailov et al. 2023) on sequence log-probs, each (P,) for P pairs -> (mean loss, metrics).

    The sequence log-prob is the response-token sum for sigmoid / hinge and the response-token mean for
    ipo (the IPO paper and TRL); the caller reduces the tokens (workers/losses.dpo_loss_fn).
    h = (log pi(y_c) - log ref(y_c)) - (log pi(y_r) - log ref(y_r))   (reference terms 0 if reference_free)
      sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps = label_smoothing, cDPO)
      ipo:     (h - 1 / (2 beta))^2                                         (Azar et al. 2023)
      hinge:   relu(1 - beta h)                                             (SLiC)
    Metrics (logged as dpo/*): rewards_chosen, rewards_rejected (the implicit rewards
    beta * (log pi - log ref)), reward_acc (share of pairs whose chosen reward is higher), reward_margin.
    """
    if reference_free:
        ref_chosen_log_probs = torch.zeros_like(chosen_log_probs)
        ref_rejected_log_probs = torch.zeros_like(rejected_log_probs)
    chosen_ratio = chosen_log_probs - ref_chosen_log_probs
    rejected_ratio = rejected_log_probs - ref_rejected_log_probs
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose one of {DPO_LOSS_TYPES}")
    chosen_rewards, rejected_rewards = (beta * chosen_ratio).detach(), (beta * rejected_ratio).detach()
    metrics = {
        "rewards_chosen": chosen_rewards.mean(),
        "rewards_rejected": rejected_rewards.mean(),
        "reward_acc": (chosen_rewards > rejected_rewards).float().mean(),
        "reward_margin": (chosen_rewards - rejected_rewards).mean(),
    }
    return losses.mean(), metrics
