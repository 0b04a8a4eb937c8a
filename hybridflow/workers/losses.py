"""Loss functions handed to `TrainEngine.train_step`: thin adapters from the engine's micro-batch
outputs to the pure algorithm functions in hybridflow/algorithms (the math lives there).

Each builder returns `loss_fn(outputs, micro_batch) -> (loss, metrics)`; `outputs` holds
"log_probs" (b, lr) [+ "entropy"] for the actor or "values" (b, lr) for a critic, aligned with the
micro-batch's (trimmed) response fields. Also the DPO and SFT losses (offline trainers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.algorithms import aggregate_loss, kl_loss, masked_mean, policy_loss, value_loss


def actor_loss_fn(actor_cfg, algo_cfg):
    """PPO clipped policy loss (+ entropy bonus, + KL loss to the reference when use_kl_loss)."""
    agg = actor_cfg.loss_agg_mode

    def loss_fn(out: dict, mb) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        log_probs = out["log_probs"]
        loss, m = policy_loss(
            log_probs,
            mb["old_log_probs"],
            mb["advantages"],
            mask,
            actor_cfg.clip_ratio_low,
            actor_cfg.clip_ratio_high,
            actor_cfg.clip_ratio_c,
            agg,
        )
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": m["clipfrac"],
            "pg_clipfrac_lower": m["clipfrac_lower"],
            "ppo_kl": m["approx_kl"],
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


def critic_loss_fn(critic_cfg, values_key: str, returns_key: str):
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


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict]:
    """DPO (Rafailov et al. 2023) on sequence log-probs, each (P,) for P pairs -> (mean loss, metrics).

    h = (pi_c - ref_c) - (pi_r - ref_r)
      sigmoid: -(1-eps) logsigmoid(beta h) - eps logsigmoid(-beta h)   (eps = label smoothing, cDPO)
      ipo:     (h - 1 / (2 beta))^2                                       (Azar et al. 2023)
      hinge:   relu(1 - beta h)                                           (SLiC)
    Metrics: implicit rewards beta*(pi - ref) of chosen / rejected, their accuracy and margin.
    """
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose sigmoid, ipo or hinge")
    chosen_r = (beta * (chosen_logps - ref_chosen_logps)).detach()
    rejected_r = (beta * (rejected_logps - ref_rejected_logps)).detach()
    metrics = {
        "rewards_chosen": chosen_r.mean(),
        "rewards_rejected": rejected_r.mean(),
        "reward_acc": (chosen_r > rejected_r).float().mean(),
        "reward_margin": (chosen_r - rejected_r).mean(),
    }
    return losses.mean(), metrics


def dpo_loss_fn(dpo_cfg):
    """DPO over a micro-batch of interleaved pairs (chosen at even rows, rejected at odd rows)."""

    def loss_fn(out: dict, mb) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"].to(out["log_probs"].dtype)
        seq = (out["log_probs"] * mask).sum(-1).view(-1, 2)  # (P, 2): chosen, rejected
        if dpo_cfg.reference_free:
            ref = torch.zeros_like(seq)
        else:
            ref = (mb["ref_log_probs"] * mask).sum(-1).view(-1, 2)
        loss, metrics = dpo_loss(
            seq[:, 0],
            seq[:, 1],
            ref[:, 0],
            ref[:, 1],
            dpo_cfg.beta,
            dpo_cfg.loss_type,
            dpo_cfg.label_smoothing,
        )
        return loss, metrics

    return loss_fn
