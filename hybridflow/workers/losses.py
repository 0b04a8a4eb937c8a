"""Loss functions handed to `TrainEngine.train_step`: thin adapters from the engine's micro-batch
outputs to the pure algorithm functions in hybridflow/algorithms (the math lives there).

Each builder returns `loss_fn(outputs, micro_batch) -> (loss, metrics)`; `outputs` holds
"log_probs" (b, lr) [+ "entropy"] for the actor or "values" (b, lr) for a critic, aligned with the
micro-batch's (trimmed) response fields. Also the SFT loss and the DPO adapter (offline trainers), and
the train-vs-rollout gap the actor loss measures on its way (`GapMeter`, below).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridflow.algorithms import (
    POLICY_LOSSES,
    aggregate_loss,
    dpo_loss,
    kl_loss,
    masked_mean,
    rollout_correction_weights,
    value_loss,
)
from hybridflow.algorithms.rollout_correction import gap_metrics, log_prob_gap_stats, reduce_gap_stats
from hybridflow.batch_meta import BatchMeta

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import ActorConfig, AlgorithmConfig, CriticConfig, DPOConfig


def split_aggregation(loss_agg_mode: str) -> tuple[str, str]:
    """loss_agg_mode -> (the micro-batch's aggregation, the engine's loss_weighting) that together give the
    mode over the whole global mini-batch whatever its split into micro-batches and dp ranks: a mean over
    tokens or sequences is the micro-batches' means weighted by their counts; token-sum is the
    token-mean times the global token count (the engine's "token-sum" weighting)."""
    if loss_agg_mode == "token-sum":
        return "token-mean", "token-sum"
    return loss_agg_mode, "tokens" if loss_agg_mode == "token-mean" else "sequences"


def actor_loss_fn(
    actor_cfg: ActorConfig,
    algo_cfg: AlgorithmConfig,
    norm_length: int,
    correct: bool = False,
    old_from_forward: bool = False,
    gap: GapMeter | None = None,
):
    """actor.policy_loss (algorithms/policy_losses.py) + entropy bonus + KL loss to the reference when
    use_kl_loss, aggregated by split_aggregation(actor.loss_agg_mode)[0]; norm_length: the constant of
    seq-mean-token-sum-norm (rollout.response_length). correct: each token's policy loss weighted by
    actor.rollout_correction's weights of the old log-probs against the rollout's (algorithms/
    rollout_correction.py), logged as is_weight_mean / is_weight_clipfrac / is_masked_frac.
    old_from_forward: the old log-probs are this forward's own, detached (an update of one optimizer
    step: trainers/sources/base.py old_log_prob_source), so the ratio is exactly 1 where the gradient is taken.
    gap: given the forward's log-probs against the rollout's, until closed (`GapMeter`, below)."""
    agg = split_aggregation(actor_cfg.loss_agg_mode)[0]
    policy, rc = POLICY_LOSSES[actor_cfg.policy_loss], actor_cfg.rollout_correction

    def loss_fn(out: dict, mb) -> tuple[torch.Tensor, dict]:
        mask = mb["response_mask"]
        log_probs = out["log_probs"]
        if gap is not None:
            gap.add(log_probs, mb["rollout_log_probs"], mask)
        old = log_probs.detach() if old_from_forward else mb["old_log_probs"]
        is_weights, is_metrics = None, {}
        if correct:
            is_weights, is_metrics = rollout_correction_weights(
                old, mb["rollout_log_probs"], mask, rc.mode, rc.level, rc.lower, rc.upper
            )
        loss, m = policy(
            log_probs, old, mb["advantages"], mask, actor_cfg.clip_ratio_low, actor_cfg.clip_ratio_high,
            actor_cfg.clip_ratio_c, agg, is_weights, norm_length,
        )  # fmt: skip
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": m["clipfrac"],
            "pg_clipfrac_lower": m["clipfrac_lower"],
            "ppo_kl": m["approx_kl"],
            **is_metrics,
        }
        if "entropy" in out:
            entropy = aggregate_loss(out["entropy"], mask, agg, norm_length)
            metrics["entropy"] = entropy.detach()
            if algo_cfg.entropy_coeff:
                loss = loss - algo_cfg.entropy_coeff * entropy
        if algo_cfg.use_kl_loss:
            kl = kl_loss(log_probs, mb["ref_log_probs"], mask, algo_cfg.kl_loss_kind, agg, norm_length)
            loss = loss + algo_cfg.kl_loss_coef * kl
            metrics["kl_loss"] = kl.detach()
        return loss, metrics

    return loss_fn


def critic_loss_fn(critic_cfg: CriticConfig, values_key: str, returns_key: str, norm_length: int):
    """Clipped value loss against `returns_key`, clipping around the rollout-time `values_key`, aggregated
    by split_aggregation(critic.loss_agg_mode)[0] (norm_length: as actor_loss_fn's)."""
    agg = split_aggregation(critic_cfg.loss_agg_mode)[0]

    def loss_fn(out: dict, mb) -> tuple[torch.Tensor, dict]:
        loss, m = value_loss(
            out["values"],
            mb[values_key],
            mb[returns_key],
            mb["response_mask"],
            critic_cfg.cliprange_value,
            agg,
            norm_length,
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


# ---- the train-vs-rollout gap, measured inside the actor's update where both sides of it exist (the math
# and the reduction rule: algorithms/rollout_correction.py; what it means per mode: docs/metrics.md).
#
# The training side is the actor's log-probs of the rollout's tokens at the weights that sampled them,
# before any optimizer step of this update:
#   "old"      the old log-probs of a separate actor forward (old_log_prob_source "actor")
#   "forward"  the update's own forward (sources "update" and "rollout": the update is then one optimizer
#              step, so its one forward runs before the weights move)


def gap_training_side(meta: BatchMeta, fields: list[str]) -> str | None:
    """ "old" | "forward" (the comment above), or None when the gap is not measured: the batch holds no
    rollout log-probs, or they follow another convention (meta.rollout_log_probs_exact False: vLLM under
    top-k / top-p), so that the gap would measure the truncated probability mass rather than a numerical
    mismatch."""
    if "rollout_log_probs" not in fields or meta.rollout_log_probs_exact is False:
        return None
    if meta.old_log_probs_source in ("update", "rollout") or "old_log_probs" not in fields:
        return "forward"
    return "old"


class GapMeter:
    """This rank's gap statistics, collected from the first forward only, then reduced over the dp ranks."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.closed = False

    def add(self, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        if not self.closed:
            self.parts.append(log_prob_gap_stats(train_log_probs, rollout_log_probs, mask))

    def close(self) -> None:
        """No more parts: what follows runs on weights an optimizer step has moved."""
        self.closed = True

    def metrics(self, group=None, device: torch.device | str = "cpu") -> dict[str, float]:
        """The step's metrics, the same on every rank (a collective over `group`, the dp ranks: each
        holds its own rows), so DP_METRICS's mean over the ranks returns them unchanged; tp ranks hold
        the same rows and gather in their own dp group."""
        parts = [p.to(device) for p in self.parts]  # the "old" side's are on the host, the forward's not
        local = reduce_gap_stats(torch.stack(parts) if parts else torch.zeros(0, device=device))
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local, group=group)
            local = reduce_gap_stats(torch.stack(gathered))
        return gap_metrics(local.cpu())  # the one host sync of the gap per step
