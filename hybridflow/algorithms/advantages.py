"""Advantage estimators: one per algorithm in docs/design.md §2 (PPO's GAE, GRPO, RLOO, ReMax, REINFORCE++).

Each is a pure function of tensors (no model, no process group) and returns `(advantages, returns)`, both
(B, L) and zero on padded response positions, so a driver can swap estimators with one line. `returns`
is the critic's regression target for GAE; for critic-free estimators it is what verl reports as
returns (useful for logging, unused for training).

Sequence-level scores may be passed as (B,) or as token-level (B, L) rewards (the masked sum is taken),
so KL-in-reward shaped `token_level_rewards` work unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridflow.algorithms.utils import group_index, masked_whiten, sequence_scores

__all__ = [
    "compute_gae",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_remax_advantages",
    "compute_reinforce_pp_advantages",
    "compute_discounted_returns",
]

GroupIds = Sequence | np.ndarray | torch.Tensor


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"expected tensors of the same (B, L) shape, got {shapes}")


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the response tokens.

    token_rewards, values, response_mask: (B, L). Returns (advantages, returns), both (B, L):
        delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   R_t = A_t + V_t
    where "t+1" is the next *valid* token: masked positions (padding, or tool output inside a
    multi-turn response) are skipped, and the value after the last valid token is 0 (episode end).
    Returns are computed before whitening; advantages are whitened over the batch when `whiten`.
    """
    _check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    mask = response_mask.float()
    rewards, values = token_rewards.float(), values.float()
    B, L = rewards.shape
    next_value = torch.zeros(B, device=rewards.device)
    next_adv = torch.zeros(B, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    with torch.no_grad():
        for t in reversed(range(L)):
            m = mask[:, t]
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            adv_t = delta + gamma * lam * next_adv
            # Carry the running quantities through masked positions unchanged.
            next_adv = m * adv_t + (1 - m) * next_adv
            next_value = m * values[:, t] + (1 - m) * next_value
            advantages[:, t] = adv_t
        advantages = advantages * mask
        returns = (advantages + values) * mask
        if whiten:
            advantages = masked_whiten(advantages, mask)
    return advantages, returns


def _group_stats(
    scores: torch.Tensor, group_ids: GroupIds
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group unbiased std, group size), each (B,)."""
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries but there are {scores.shape[0]} scores")
    idx, G = group_index(group_ids, device=scores.device)
    count = torch.zeros(G, device=scores.device).index_add_(0, idx, torch.ones_like(scores))
    mean = torch.zeros(G, device=scores.device).index_add_(0, idx, scores) / count
    sq = torch.zeros(G, device=scores.device).index_add_(0, idx, (scores - mean[idx]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[idx], std[idx], count[idx]


def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: GroupIds,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): A_i = (s_i - mean_g) / (std_g + eps), the same for every token of i.

    scores: (B,) or token-level (B, L); group_ids: (B,) uids (numpy object array, list or tensor);
    response_mask: (B, L). norm_by_std=False is Dr. GRPO (Liu et al. 2025): A_i = s_i - mean_g.
    std is the unbiased group std. A group of one has no baseline, so its advantage is 0.
    """
    s = sequence_scores(scores, response_mask)
    mean, std, _ = _group_stats(s, group_ids)
    adv = s - mean
    if norm_by_std:
        adv = adv / (std + eps)
    advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


def compute_rloo_advantages(
    scores: torch.Tensor, group_ids: GroupIds, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean of the *other* samples in i's group.

    scores: (B,) or (B, L); group_ids: (B,); response_mask: (B, L). Equals n/(n-1) * (s_i - mean_g).
    A group of one has no other samples, so its advantage is 0.
    """
    s = sequence_scores(scores, response_mask)
    mean, _, n = _group_stats(s, group_ids)
    adv = torch.where(n > 1, (s - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(s))
    advantages = adv.unsqueeze(-1) * response_mask
    return advantages, advantages.clone()


def compute_remax_advantages(
    scores: torch.Tensor, baseline_scores: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): the greedy response's score is the baseline. A_t = G_t - b.

    scores: (B,) sequence scores, or token-level rewards (B, L) whose undiscounted reward-to-go G_t is
    used per token; baseline_scores: (B,) the greedy response's score; response_mask: (B, L).
    Returns (advantages, returns) with returns = G_t.
    """
    mask = response_mask.float()
    if scores.dim() == 2:
        _check_same_shape(scores=scores, response_mask=response_mask)
        returns = torch.flip(torch.cumsum(torch.flip(scores.float() * mask, [-1]), -1), [-1]) * mask
    else:
        returns = sequence_scores(scores, response_mask).unsqueeze(-1) * mask
    advantages = (returns - baseline_scores.float().unsqueeze(-1)) * mask
    return advantages, returns


def compute_discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} with t' the next valid token; (B, L) -> (B, L), zero on padding."""
    _check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    mask = response_mask.float()
    rewards = token_rewards.float()
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        ret_t = rewards[:, t] * m + gamma * running
        running = m * ret_t + (1 - m) * running
        returns[:, t] = ret_t
    return returns * mask


def compute_reinforce_pp_advantages(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over all valid tokens of the batch.

    token_rewards, response_mask: (B, L) (token_rewards usually carry the KL penalty per token).
    Returns (advantages, returns).
    """
    with torch.no_grad():
        returns = compute_discounted_returns(token_rewards, response_mask, gamma)
        advantages = masked_whiten(returns, response_mask.float())
    return advantages, returns
