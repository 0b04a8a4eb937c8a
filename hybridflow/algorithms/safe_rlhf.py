"""Safe-RLHF (Dai et al. 2023): maximise reward subject to E[cost] <= cost_limit via a Lagrangian.

The primal problem  max_pi E[R]  s.t.  E[C] <= d  becomes  min_{lambda>=0} max_pi E[R] - lambda (E[C] - d).
The actor follows the combined advantage (A_r - lambda A_c) / (1 + lambda) (dividing by 1 + lambda
keeps its scale bounded as lambda grows); lambda does projected gradient ascent on the constraint
violation. The reward and cost critics each get their own GAE.

As in the PKU implementation (safe-rlhf's PPO-Lag trainer): the KL penalty beta * KL_t enters both
returns, -beta KL_t into the reward and +beta KL_t into the cost (`add_kl_to_costs`), so the actor's
combined advantage carries the whole penalty whatever lambda is; and neither GAE is whitened (they are
combined on their own scales). Departure: PKU updates log(lambda) with SGD; we take the plain projected
step, which keeps lambda exactly 0 while the constraint holds (docs/design.md §6).
"""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.advantages import compute_gae

__all__ = [
    "add_kl_to_costs",
    "compute_safe_rlhf_advantages",
    "combine_reward_cost_advantages",
    "update_lagrange_multiplier",
]


def update_lagrange_multiplier(
    lmbda: float, mean_cost: float, cost_limit: float, lr: float, lambda_max: float = math.inf
) -> float:
    """lambda <- max(0, lambda + lr * (mean_cost - cost_limit)): grows while the cost exceeds its limit.

    lambda_max optionally caps it, so a long violation cannot make the reward term vanish entirely.
    """
    return min(lambda_max, max(0.0, float(lmbda) + lr * (float(mean_cost) - cost_limit)))


def add_kl_to_costs(token_costs: torch.Tensor, kl_penalty: torch.Tensor) -> torch.Tensor:
    """Token-level costs (B, L) plus the KL penalty beta * KL_t (B, L) that the reward lost.

    Why: GAE is linear in the rewards, so with -beta KL in the reward and +beta KL in the cost the
    combined advantage (A_r - lambda A_c) / (1 + lambda) holds exactly -beta KL's advantage for every
    lambda; with the KL in the reward only it would shrink by 1 / (1 + lambda) as the constraint bites.
    """
    return token_costs + kl_penalty


def combine_reward_cost_advantages(
    reward_advantages: torch.Tensor, cost_advantages: torch.Tensor, lmbda: float
) -> torch.Tensor:
    """(A_r - lambda * A_c) / (1 + lambda). Both (B, L) -> (B, L)."""
    if lmbda < 0:
        raise ValueError(f"the Lagrange multiplier must be >= 0, got {lmbda}")
    return (reward_advantages - lmbda * cost_advantages) / (1.0 + lmbda)


def compute_safe_rlhf_advantages(
    reward_token_rewards: torch.Tensor,
    reward_values: torch.Tensor,
    cost_token_rewards: torch.Tensor,
    cost_values: torch.Tensor,
    response_mask: torch.Tensor,
    lmbda: float,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE for reward and for cost, then the combined advantage. All inputs (B, L); the token rewards
    already carry the KL split (reward - beta KL, cost + beta KL: `add_kl_to_costs`).

    Returns (advantages, reward_returns, cost_returns): the actor trains on `advantages`, the reward
    critic on `reward_returns`, the cost critic on `cost_returns`. Neither GAE is whitened, as in the
    PKU implementation: whitening each separately would rescale the reward and the cost differently
    and break the KL split above.
    """
    reward_adv, reward_returns = compute_gae(
        reward_token_rewards, reward_values, response_mask, gamma, lam, whiten=False
    )
    cost_adv, cost_returns = compute_gae(
        cost_token_rewards, cost_values, response_mask, gamma, lam, whiten=False
    )
    advantages = combine_reward_cost_advantages(reward_adv, cost_adv, lmbda) * response_mask
    return advantages, reward_returns, cost_returns
