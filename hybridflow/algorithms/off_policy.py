"""Off-policy correction for a rollout one step behind the actor (trainer.rollout_ahead=1; docs/design.md
"One-step-ahead rollout").

The batch trained at step k was sampled by the rollout pool with the weights of step k-1 (the behaviour
policy mu); PPO's ratio is taken against the actor's own log-probs before the update (pi_old, recomputed
by the actor). The gap mu -> pi_old is corrected per token with a truncated importance weight
(Espeholt et al. 2018, IMPALA; verl's `tis_imp_ratio_cap`):

    w_t = min(exp(log pi_old(a_t) - log mu(a_t)), C)

which multiplies the token's policy loss. Truncating at C bounds the variance one stale token can add.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.utils import masked_mean

__all__ = ["truncated_is_weights"]


def truncated_is_weights(
    old_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights min(exp(old - behaviour), cap), shape (B, L), no grad (both inputs are data).

    old_log_probs: the actor's log-probs before the update; behaviour_log_probs: the rollout's log-probs
    of the same tokens (the policy that sampled them); response_mask (B, L) marks the valid tokens.
    Returns (weights, metrics): is_weight_mean (masked mean of the truncated weights) and
    is_weight_clipfrac (share of valid tokens whose weight the cap truncated).
    """
    if cap <= 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap}")
    mask = response_mask.to(old_log_probs.dtype)
    # clamp before exp: a token the behaviour policy found far less likely must not overflow to inf
    ratio = torch.exp(torch.clamp(old_log_probs - behaviour_log_probs, -20.0, 20.0)).detach()
    weights = torch.clamp(ratio, max=cap)
    metrics = {
        "is_weight_mean": masked_mean(weights, mask).detach(),
        "is_weight_clipfrac": masked_mean((ratio > cap).to(mask.dtype), mask).detach(),
    }
    return weights, metrics
