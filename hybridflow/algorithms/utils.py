"""Masked statistics and small tensor helpers shared by the advantage estimators and losses.

Every statistic here takes a mask because responses are right-padded: padding must never leak into a
mean, a variance or a whitening. Shapes: B = batch (sequences), L = response length, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "entropy_from_logits",
    "log_probs_from_logits",
    "explained_variance",
    "place_score_on_last_token",
    "sequence_scores",
    "group_index",
]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1. values, mask: same shape (e.g. (B, L)); dim=None sums everything."""
    prod = values * mask
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1 (0 when the mask is empty, never NaN).

    values, mask: same shape. dim=None -> scalar; dim=-1 on (B, L) -> (B,).
    """
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: int | None = None
) -> torch.Tensor:
    """Variance over masked positions; unbiased (Bessel) by default. Fewer than 2 valid entries -> 0."""
    mean = masked_mean(values, mask, dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    sq = masked_sum((values - mean) ** 2, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    denom = (count - 1) if unbiased else count
    return torch.where(count > 1, sq / denom.clamp(min=1), torch.zeros_like(sq))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values - mean) / std over masked positions of the whole tensor; padded positions become 0.

    shift_mean=False adds the mean back (scale only), as PPO implementations do for rewards.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last dim. logits (..., V) -> (...).

    H = logsumexp(z) - sum(softmax(z) * z): one softmax, no log of small probabilities.
    """
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels]. logits (..., V), labels (...) int -> (...) float32."""
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[returns - values] / Var[returns] over masked positions (1 = perfect critic, <= 0 = useless).

    When the returns have no variance the ratio is undefined; we return 0 rather than NaN.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    return torch.where(
        var_returns > 0, 1 - var_residual / var_returns.clamp(min=1e-12), torch.zeros_like(var_returns)
    )


def place_score_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's scalar score on its last valid response token (the reward model convention).

    scores (B,), response_mask (B, L) -> token-level scores (B, L), zero elsewhere. A row with an empty
    mask gets no score (there is no token to credit; every masked statistic ignores that row anyway).
    """
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must have shape (B,) matching response_mask (B, L); got {tuple(scores.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    B, L = response_mask.shape
    positions = torch.arange(L, device=response_mask.device).expand(B, L)
    # Last index where mask is 1 (works for masks with holes too, not only right padding).
    last = torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values
    out = torch.zeros(B, L, dtype=torch.float32, device=response_mask.device)
    has_token = last >= 0
    rows = torch.arange(B, device=response_mask.device)[has_token]
    out[rows, last[has_token]] = scores.to(out.dtype)[has_token]
    return out


def sequence_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Accept (B,) sequence scores or (B, L) token-level scores; return (B,) float32 (masked token sum)."""
    if scores.dim() == 2:
        return masked_sum(scores.float(), response_mask, dim=-1)
    if scores.dim() == 1:
        return scores.float()
    raise ValueError(f"scores must be (B,) or (B, L); got shape {tuple(scores.shape)}")


def group_index(group_ids: Sequence | np.ndarray | torch.Tensor, device=None) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (uid strings in a numpy object array, ints, or a tensor) to 0..G-1.

    Returns (index (B,) long, G). Groups are numbered in order of first appearance.
    """
    if isinstance(group_ids, torch.Tensor):
        _, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse.to(device=device, dtype=torch.long), int(inverse.max().item()) + 1 if len(
            inverse
        ) else 0
    numbering: dict = {}
    # A dict, not np.unique: uids may be mixed or unorderable objects; only hashing is needed.
    index = [
        numbering.setdefault(g.item() if isinstance(g, np.generic) else g, len(numbering)) for g in group_ids
    ]
    return torch.tensor(index, dtype=torch.long, device=device), len(numbering)
