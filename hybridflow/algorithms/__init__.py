"""RL algorithms as pure tensor functions: advantage estimators, losses, KL, Safe-RLHF, masked statistics.

No process groups, no configs, no models: drivers and workers call these on tensors. Files:
  advantages.py  GAE (PPO), GRPO / Dr.GRPO, RLOO, ReMax, REINFORCE++
  losses.py      PPO clipped policy loss (dual clip), clipped value loss, DPO loss, loss aggregation
  policy_losses.py  the policy losses by name (actor.policy_loss): vanilla, gspo, cispo, geo_mean
  rollout_correction.py  the rollout-vs-training gap: importance weights / masks (TIS, MIS, IcePop) and its
                 per-rank log-prob statistics reduced over dp ranks
  kl.py          KL estimators k1/k2/k3/abs, KL-in-reward, KL loss, fixed / adaptive KL controllers
  dynamic_sampling.py  DAPO: groups to keep, overlong penalty, truncated rows, the kept-group accumulator
  safe_rlhf.py   reward & cost advantages, Lagrange multiplier update, combined advantage
  utils.py       masked mean / var / whiten, entropy and log-probs from logits, explained variance
"""

from hybridflow.algorithms.advantages import (
    compute_discounted_returns,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
)
from hybridflow.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
    kl_penalty,
)
from hybridflow.algorithms.losses import (
    AGG_MODES,
    DPO_LOSS_TYPES,
    aggregate_loss,
    dpo_loss,
    policy_loss,
    value_loss,
)
from hybridflow.algorithms.policy_losses import POLICY_LOSSES
from hybridflow.algorithms.rollout_correction import rollout_correction_weights
from hybridflow.algorithms.safe_rlhf import (
    add_kl_to_costs,
    combine_reward_cost_advantages,
    compute_safe_rlhf_advantages,
    update_lagrange_multiplier,
)
from hybridflow.algorithms.utils import (
    entropy_from_logits,
    explained_variance,
    group_index,
    log_probs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    place_score_on_last_token,
    sequence_scores,
)

__all__ = [
    "AGG_MODES",
    "DPO_LOSS_TYPES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "add_kl_to_costs",
    "combine_reward_cost_advantages",
    "compute_discounted_returns",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_reinforce_pp_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_safe_rlhf_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "group_index",
    "kl_loss",
    "kl_penalty",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "place_score_on_last_token",
    "policy_loss",
    "sequence_scores",
    "rollout_correction_weights",
    "update_lagrange_multiplier",
    "value_loss",
]
