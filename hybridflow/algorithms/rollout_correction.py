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
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.utils import masked_mean

__all__ = ["CORRECTION_LEVELS", "CORRECTION_MODES", "rollout_correction_weights"]

CORRECTION_MODES = ("none", "tis", "mis", "icepop", "geo_mask")
CORRECTION_LEVELS = ("token", "sequence")
_LOG_CLAMP = 20.0  # log-ratios clamped before exp: a token mu found far less likely must not give inf


def _log_rho(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(B, L) log-ratio per token, or each sequence's summed log-ratio broadcast over its tokens."""
    log_rho = (old - rollout) * mask
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(old)
    return torch.clamp(log_rho, -_LOG_CLAMP, _LOG_CLAMP)


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
