"""What each algorithm needs, said once: the models it runs, whether it generates, its rollout.n.

Each trainer class (hybridflow/trainers) carries its `AlgorithmSpec` as `spec`; validation
(config/validate.py), placement (trainers/placement.py) and the planner bridge
(trainers/auto_placement.py) ask the spec instead of keeping their own lists. The specs live here,
not in the trainer modules, so that the config package stays importable without torch or Ray;
tests/trainers/test_algorithm_specs.py checks every trainer class points at its spec.

Roles are the trainer's worker roles (trainers/placement.py ROLES), in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLE_ORDER = ("actor_rollout", "ref", "critic", "cost_critic", "reward", "cost")


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    adv_estimator: str  # the advantage estimator it uses ("none": offline, no advantages)
    critic: bool = False  # trains a value model (critic)
    cost: bool = False  # Safe-RLHF: scores a cost (rule or cost model) and trains a cost critic
    generation: bool = True  # samples responses online (False: trains on a fixed dataset)
    min_n: int = 1  # smallest rollout.n: group baselines need at least two samples per prompt
    reference: str = "kl"  # when the reference model runs: "kl" (a KL term needs it) | "dpo" | "never"
    planner: str = ""  # the planner's dataflow for it ("" = none: placement must be colocate/split)
    pairs: bool = False  # trains on (chosen, rejected) pairs: both rows of a pair on one dp rank

    def uses_reference(self, cfg) -> bool:
        a = cfg.algorithm
        if self.reference == "kl":
            return a.kl.in_reward or a.use_kl_loss
        return self.reference == "dpo" and not a.dpo.reference_free

    def roles(self, cfg) -> tuple[str, ...]:
        """The worker roles a run of this algorithm with `cfg` starts."""
        wanted = {
            "actor_rollout": True,
            # with LoRA the reference is the actor with its adapters off: no model of its own (models/lora.py)
            "ref": self.uses_reference(cfg) and not cfg.model.lora.enabled,
            "critic": self.critic,
            "cost_critic": self.cost,
            "reward": self.generation and cfg.reward.kind == "model",
            "cost": self.cost and not cfg.algorithm.safe_rlhf.cost_fn,
        }
        return tuple(r for r in ROLE_ORDER if wanted[r])


ALGORITHM_SPECS = {
    s.name: s
    for s in (
        AlgorithmSpec("ppo", "gae", critic=True, planner="ppo"),
        AlgorithmSpec("grpo", "grpo", min_n=2, planner="grpo"),
        AlgorithmSpec("dapo", "grpo", min_n=2, planner="grpo"),  # GRPO + dynamic sampling (trainers/dapo.py)
        AlgorithmSpec("remax", "remax", planner="remax"),
        AlgorithmSpec("rloo", "rloo", min_n=2, planner="grpo"),  # GRPO's models and stages
        AlgorithmSpec("reinforce_pp", "reinforce_pp", planner="grpo"),
        AlgorithmSpec("safe_rlhf", "gae", critic=True, cost=True, planner="safe-rlhf"),
        AlgorithmSpec("dpo", "none", generation=False, reference="dpo", pairs=True),
        AlgorithmSpec("sft", "none", generation=False, reference="never"),
    )
}
ALGORITHMS = tuple(ALGORITHM_SPECS)


def algorithm_spec(cfg) -> AlgorithmSpec:
    """The spec of cfg.algorithm.name (validation has checked the name is one of ALGORITHMS)."""
    return ALGORITHM_SPECS[cfg.algorithm.name]
