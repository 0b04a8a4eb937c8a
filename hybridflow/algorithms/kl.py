"""KL divergence to the reference policy: per-token estimators, KL-in-reward, KL-as-loss, coefficient control.

Two ways to keep the actor near the reference (docs/design.md §2): subtract beta * KL from the token rewards before
computing advantages (`apply_kl_penalty`, InstructGPT/PPO style, with a fixed or adaptive beta), or add
a KL term to the actor loss (`kl_loss`, GRPO style, usually with the low-variance k3 estimator).

Estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence", 2020),
with d = log pi - log pi_ref per token:
  k1  = d                        unbiased, high variance, can be negative
  abs = |d|
  k2  = 0.5 * d^2   ("mse")      low variance, biased
  k3  = exp(-d) - 1 + d  ("low_var_kl")  unbiased and >= 0; clamped to [-10, 10] for stability
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridflow.algorithms.losses import aggregate_loss
from hybridflow.algorithms.utils import masked_mean

__all__ = [
    "KL_KINDS",
    "kl_penalty",
    "kl_loss",
    "apply_kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "build_kl_controller",
]

_ALIASES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KL_KINDS = tuple(_ALIASES)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate. log_probs, ref_log_probs: (B, L) -> (B, L), not masked.

    kind: k1 | kl, abs, k2 | mse, k3 | low_var_kl (see the module docstring).
    """
    try:
        kind = _ALIASES[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}") from None
    d = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    # k3: the ratio pi_ref/pi is exp(-d); clamp d first so exp cannot overflow on stale samples.
    neg = torch.clamp(-d, -20.0, 20.0)
    return torch.clamp(torch.exp(neg) - neg - 1, -10.0, 10.0)


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    agg: str = "token-mean",
    norm_length: int | None = None,
) -> torch.Tensor:
    """KL as an actor loss term (GRPO): aggregate_loss(kl_penalty(...), mask, agg, norm_length). Inputs
    (B, L) -> scalar."""
    mask = response_mask.to(log_probs.dtype)
    return aggregate_loss(kl_penalty(log_probs, ref_log_probs, kind), mask, agg, norm_length)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward: token_level_rewards = token_level_scores - kl_coef * KL_t on valid tokens.

    All inputs (B, L). Returns (token_level_rewards (B, L), current_kl 0-d) where current_kl is the
    batch mean of each sequence's mean per-token KL; feed it to the KL controller's `update`.
    """
    mask = response_mask.float()
    kl = kl_penalty(log_probs, ref_log_probs, kind) * mask
    rewards = token_level_scores.float() - kl_coef * kl
    current_kl = masked_mean(kl, mask, dim=-1).mean()
    return rewards, current_kl.detach()


@dataclass
class FixedKLController:
    """A constant KL coefficient. `update` is a no-op, kept so drivers treat both controllers alike."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass
class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-tuning LMs from human preferences", §2.2).

    After each batch: e = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + e * n_steps / horizon.
    So beta grows when the policy drifts further than target_kl and shrinks when it stays closer.
    n_steps is the number of samples in the batch (the horizon is counted in samples, as in the paper).
    """

    value: float
    target_kl: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target_kl > 0 and horizon > 0 (got {self.target_kl}, {self.horizon})"
            )

    def update(self, current_kl: float, n_steps: int) -> None:
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            return  # a NaN KL would poison beta forever; the loss/metrics already show the problem
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state["target_kl"])
        self.horizon = int(state["horizon"])


def build_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """kind 'fixed' or 'adaptive' (the latter needs target_kl and horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("the adaptive KL controller needs target_kl and horizon (e.g. 6.0 and 10000)")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; choose 'fixed' or 'adaptive'")
