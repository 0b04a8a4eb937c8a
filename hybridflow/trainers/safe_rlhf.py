"""Safe-RLHF (Dai et al. 2023): PPO with a cost as well as a reward, each with its own critic, and a
Lagrange multiplier lambda that trades them off: the actor follows (A_r - lambda A_c) / (1 + lambda)
and lambda rises while the mean cost exceeds algorithm.safe_rlhf.cost_limit (hybridflow/algorithms/
safe_rlhf.py). The cost is a cost model (model.cost_model_path) or a rule (safe_rlhf.cost_fn).

Edits of PPO: values also from the cost critic, reward also scores the cost, advantages add the cost
(as in the PKU implementation, the cost gets +beta KL where the reward gets -beta KL) and combine the
two unwhitened GAEs, the critic update also trains the cost critic."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms import add_kl_to_costs, compute_safe_rlhf_advantages, update_lagrange_multiplier
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.experience import Pending
from hybridflow.trainers.ppo import PPOTrainer
from hybridflow.workers import RuleReward, token_level

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import AlgorithmConfig


def safe_rlhf_advantages(batch: Batch, algo: AlgorithmConfig, state: dict) -> dict:
    """The cost on its last token plus beta KL_t (the beta KL_t the reward lost, 0 without
    kl.in_reward), lambda moved by the batch's mean cost, then (A_r - lambda A_c) / (1 + lambda) from
    the two unwhitened GAEs. Runs where make_experience does; the driver keeps lambda."""
    s = algo.safe_rlhf
    costs = batch["costs"] if "costs" in batch else batch["cost_scores"]
    batch["costs"] = costs
    kl_penalty = batch["token_level_scores"] - batch["token_level_rewards"]
    batch["token_level_costs"] = add_kl_to_costs(token_level(costs, batch["response_mask"]), kl_penalty)
    mean_cost = float(costs.mean())
    lagrange = min(
        s.lambda_max, update_lagrange_multiplier(state["lagrange"], mean_cost, s.cost_limit, s.lambda_lr)
    )
    batch["advantages"], batch["returns"], batch["cost_returns"] = compute_safe_rlhf_advantages(
        batch["token_level_rewards"], batch["values"], batch["token_level_costs"], batch["cost_values"],
        batch["response_mask"], lagrange, algo.gamma, algo.lam,
    )  # fmt: skip
    return {
        "safe_rlhf/lambda": lagrange,
        "safe_rlhf/cost_mean": mean_cost,
        "safe_rlhf/cost_limit": s.cost_limit,
    }


class SafeRLHFTrainer(PPOTrainer):
    name = "safe_rlhf"
    spec = ALGORITHM_SPECS["safe_rlhf"]  # a cost (rule or cost model) is required: validation says so
    advantage_fn = staticmethod(safe_rlhf_advantages)

    def __init__(self, config, placement=None, groups=None):
        super().__init__(config, placement, groups)
        s = self.cfg.algorithm.safe_rlhf
        self.lagrange = s.lambda_init
        self.rule_cost = (
            RuleReward(self.cfg.reward, fn=s.cost_fn, output_dir=self.cfg.run_dir) if s.cost_fn else None
        )

    def values(self, batch) -> Pending:
        batch = super().values(batch)
        return self.scored_output("cost_critic", "compute_values", batch)

    def reward(self, batch) -> Pending:
        batch = super().reward(batch)
        if self.rule_cost is None:
            return self.scored_output("cost", "compute_reward", batch)
        batch["costs"] = self.rule_cost(batch.local)[0]
        return batch

    def advantage_state(self) -> dict:
        return {"lagrange": self.lagrange}

    def after_experience(self, metrics: dict) -> None:
        self.lagrange = metrics["safe_rlhf/lambda"]

    def update_critic(self, batch: Pending) -> None:
        super().update_critic(batch)
        self.updates.append(self.groups["cost_critic"].update_critic.future(batch.experience))

    def extra_state(self) -> dict:
        return {**super().extra_state(), "lagrange": self.lagrange}

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        self.lagrange = float(state.get("lagrange", self.lagrange))

    def close(self) -> None:
        if self.rule_cost is not None:
            self.rule_cost.close()
        super().close()
