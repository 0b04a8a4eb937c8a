"""Loss functions handed to `TrainEngine.train_step`: thin adapters from the engine's micro-batch
outputs to the pure algorithm functions in hybridflow/algorithms (the math lives there).

Each builder returns `loss_fn(outputs, micro_batch) -> (loss, metrics)`; `outputs` holds
"log_probs" (b, lr) [+ "entropy"] for the actor or "values" (b, lr) for a critic, aligned with the
micro-batch's (trimmed) response fields. Also the SFT loss and the DPO adapter (offline trainers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridflow.algorithms import (
    aggregate_loss,
    dpo_loss,
    kl_loss,
    masked_mean,
    policy_loss,
    truncated_is_weights,
    value_loss,
)

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import ActorConfig, AlgorithmConfig, CriticConfig, DPOConfig
    from hybridflow.workers.gap_meter import GapMeter


def actor_loss_fn(
    actor_cfg: ActorConfig,
    algo_cfg: AlgorithmConfig,
    is_cap: float = 0.0,
    old_from_forward: bool = False,
    gap: GapMeter | None = None,
):
    """PPO clipped policy loss (+ entropy bonus, + KL loss to the reference when use_kl_loss). is_cap > 0:
    each token's policy loss weighted by min(exp(old - rollout log-prob), is_cap) (a rollout one step
    behind: algorithms/off_policy.py), logged as is_weight_mean / is_weight_clipfrac. old_from_forward:
    the old log-probs are this forward's own, detached (an update of one optimizer step: trainers/sources/
    base.py old_log_prob_source), so the ratio is exactly 1 where the gradient is taken. gap: given the
    forward's log-probs against the rollout's, until closed (workers/gap_meter.py)."""
    agg = actor_cfg.loss_agg_mode

    def loss_fn(out: dict, mb) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        log_probs = out["log_probs"]
        if gap is not None:
            gap.add(log_probs, mb["rollout_log_probs"], mask)
        old = log_probs.detach() if old_from_forward else mb["old_log_probs"]
        is_weights, is_metrics = None, {}
        if is_cap > 0:
            is_weights, is_metrics = truncated_is_weights(old, mb["rollout_log_probs"], mask, is_cap)
        loss, m = policy_loss(
            log_probs,
            old,
            mb["advantages"],
            mask,
            actor_cfg.clip_ratio_low,
            actor_cfg.clip_ratio_high,
            actor_cfg.clip_ratio_c,
            agg,
            is_weights,
        )
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": m["clipfrac"],
            "pg_clipfrac_lower": m["clipfrac_lower"],
            "ppo_kl": m["approx_kl"],
            **is_metrics,
        }
        if "entropy" in out:
            entropy = aggregate_loss(out["entropy"], mask, agg)
            metrics["entropy"] = entropy.detach()
            if algo_cfg.entropy_coeff:
                loss = loss - algo_cfg.entropy_coeff * entropy
        if algo_cfg.use_kl_loss:
            kl = kl_loss(log_probs, mb["ref_log_probs"], mask, algo_cfg.kl_loss_kind, agg)
            loss = loss + algo_cfg.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics

    return loss_fn


def critic_loss_fn(critic_cfg: CriticConfig, values_key: str, returns_key: str):
    """Clipped value loss against `returns_key`, clipping around the rollout-time `values_key`."""

    def loss_fn(out: dict, mb) -> tuple[torch.Tensor, dict]:
        loss, m = value_loss(
            out["values"],
            mb[values_key],
            mb[returns_key],
            mb["response_mask"],
            critic_cfg.cliprange_value,
            critic_cfg.loss_agg_mode,
        )
        return loss, {
            "vf_loss": loss.detach(),
            "vf_clipfrac": m["vf_clipfrac"],
            "vpred_mean": m["vpred_mean"],
        }

    return loss_fn


def sft_loss(out: dict, mb) -> tuple[torch.Tensor, dict]:
    """Token-mean negative log-likelihood of the response tokens."""
    mask = mb["response_mask"]
    nll = -masked_mean(out["log_probs"], mask.to(out["log_probs"].dtype))
    return nll, {"nll": nll.detach()}


def dpo_loss_fn(dpo_cfg: DPOConfig):
    """DPO over a micro-batch of interleaved pairs (chosen at even rows, rejected at odd rows).

    Sequence log-probs are token sums, except for IPO: token means, as in the IPO paper (Azar et al.
    2023) and TRL, so the 1 / (2 beta) margin does not depend on the response lengths."""

    def loss_fn(out: dict, mb) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"].to(out["log_probs"].dtype)
        length = mask.sum(-1).clamp(min=1) if dpo_cfg.loss_type == "ipo" else 1.0

        def seq(log_probs):  # (2P, L) -> (P, 2): chosen, rejected
            return ((log_probs * mask).sum(-1) / length).view(-1, 2)

        pi = seq(out["log_probs"])
        ref = torch.zeros_like(pi) if dpo_cfg.reference_free else seq(mb["ref_log_probs"])
        return dpo_loss(
            pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], dpo_cfg.beta, dpo_cfg.loss_type, dpo_cfg.label_smoothing
        )

    return loss_fn
