"""Pure tensor functions from next-token logits to (token, log-prob): temperature, top-k, top-p.

Log-prob convention (documented because training must match it): the returned log-prob of a token is
`log_softmax(logits / T)` over the FULL vocabulary, where T is the sampling temperature (1.0 when
greedy). Top-k / top-p truncation is NOT reflected in it. This is what verl computes for
`old_log_probs` (logits divided by the rollout temperature), so `rollout_log_probs` and a training
recompute agree up to numerics, and the PPO ratio is not biased by the truncation mask.
"""

from __future__ import annotations

import torch

from hybridflow.rollout.params import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits: (B, V). Keep the k largest per row; others -> -inf. k <= 0 or k >= V is a no-op."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits: (B, V). Nucleus filter: keep the smallest top set with mass >= p (always >= 1 token)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    # Mass strictly before each token; a token is dropped if that alone already reaches p.
    mass_before = probs.cumsum(-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (B, V) raw model logits. Returns tokens (B,) int64 and their log-probs (B,) float32
    under log_softmax(logits / T) (see module docstring)."""
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(-1)
        logp = logits.log_softmax(-1)
    else:
        scaled = logits / params.temperature
        logp = scaled.log_softmax(-1)
        filtered = apply_top_p(apply_top_k(scaled, params.top_k), params.top_p)
        probs = filtered.softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
