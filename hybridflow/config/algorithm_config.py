"""The `algorithm` section of the configuration tree (config/schema.py composes it into
`HybridFlowConfig`): the algorithm's name and loss settings, and one sub-section per algorithm family.
Same conventions as config/schema.py (help text on every field; docs/design.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.algorithms import ALGORITHM_SPECS, ALGORITHMS
from hybridflow.config.dapo import FilterGroupsConfig
from hybridflow.fields import section, setting

_f, _sub = setting, section  # short names keep the field lists readable

# kept equal to hybridflow.algorithms (kl.KL_KINDS) without importing torch here
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


@dataclass
class KLConfig:
    """KL penalty folded into the reward (PPO-style, per token)."""

    in_reward: bool = _f(False, "subtract coef * KL(actor || reference) from the token-level reward")
    coef: float = _f(0.001, "initial KL coefficient (beta)", ge=0)
    kind: str = _f("low_var_kl", "KL estimator", choices=KL_KINDS)
    controller: str = _f(
        "fixed", "keep coef fixed or adapt it toward `target` (Ziegler et al.)", choices=("fixed", "adaptive")
    )
    target: float = _f(0.1, "target KL for the adaptive controller", gt=0)
    horizon: int = _f(10000, "horizon (in samples) of the adaptive controller", ge=1)


@dataclass
class SafeRLHFConfig:
    """Safe-RLHF: reward minus lambda * cost, with a Lagrange multiplier learned by gradient ascent."""

    cost_limit: float = _f(0.0, "the expected cost the policy must stay below")
    lambda_init: float = _f(1.0, "initial Lagrange multiplier", ge=0)
    lambda_lr: float = _f(0.01, "learning rate of the Lagrange multiplier", ge=0)
    lambda_max: float = _f(
        100.0, "upper clamp of the Lagrange multiplier (it is always >= 0; .inf = none)", ge=0, finite=False
    )
    cost_fn: str = _f(
        "", "rule cost: a registered name or 'path/to/file.py:function_name' ('' = model.cost_model_path)"
    )


@dataclass
class DPOConfig:
    """Direct Preference Optimization (offline: chosen/rejected pairs, no generation)."""

    beta: float = _f(0.1, "inverse temperature of the implicit reward", gt=0)
    label_smoothing: float = _f(
        0.0, "conservative DPO: assumed probability that a preference label is flipped", ge=0, lt=0.5
    )
    loss_type: str = _f("sigmoid", "DPO loss variant", choices=("sigmoid", "ipo", "hinge"))
    reference_free: bool = _f(False, "ignore the reference model (implicit reference = uniform)")


@dataclass
class SFTConfig:
    """Supervised fine-tuning on (prompt, response) pairs; loss on response tokens only."""

    max_length: int = _f(
        0,
        "max prompt + response tokens of a training example; the response gets what its prompt leaves "
        "(0 = data.max_prompt_length + rollout.response_length)",
        ge=0,
    )


@dataclass
class AlgorithmConfig:
    name: str = _f("ppo", "the RL algorithm", choices=ALGORITHMS)
    adv_estimator: str = _f(
        "",
        "advantage estimator; each algorithm has its own ('' = derive from name: ppo/safe_rlhf->gae, "
        "grpo, remax, rloo, reinforce_pp; dpo/sft->none); another value is rejected",
        choices=("", *sorted({s.adv_estimator for s in ALGORITHM_SPECS.values()})),
    )
    gamma: float = _f(1.0, "discount factor", unit=True)
    lam: float = _f(1.0, "GAE lambda", unit=True)
    norm_by_std: bool = _f(True, "GRPO: divide group-centred rewards by the group std (False = Dr. GRPO)")
    kl: KLConfig = _sub(KLConfig, "KL penalty in the reward")
    use_kl_loss: bool = _f(False, "add a KL(actor || reference) term to the actor loss (GRPO-style)")
    kl_loss_coef: float = _f(0.001, "weight of the KL loss term", ge=0)
    kl_loss_kind: str = _f("low_var_kl", "KL estimator of the KL loss", choices=KL_KINDS)
    entropy_coeff: float = _f(0.0, "entropy bonus weight in the actor loss", ge=0)
    filter_groups: FilterGroupsConfig = _sub(
        FilterGroupsConfig, "DAPO's dynamic sampling (algorithm.name=dapo)"
    )
    safe_rlhf: SafeRLHFConfig = _sub(SafeRLHFConfig, "Safe-RLHF settings")
    dpo: DPOConfig = _sub(DPOConfig, "DPO settings")
    sft: SFTConfig = _sub(SFTConfig, "SFT settings")


def algorithm_errors(a: AlgorithmConfig) -> list[str]:
    """The `algorithm` section's own checks (what it needs of other sections: config/validate.py); its
    ranges are the fields' domains (fields.domain_errors)."""
    return []
