"""Safe-RLHF (Dai et al. 2023): PPO with a cost as well as a reward, each with its own critic, and a
Lagrange multiplier lambda that trades them off: the actor follows (A_r - lambda A_c) / (1 + lambda)
and lambda rises while the mean cost exceeds algorithm.safe_rlhf.cost_limit (hybridflow/algorithms/
safe_rlhf.py). The cost is a cost model (model.cost_model_path) or a rule (safe_rlhf.cost_fn).

Edits of PPO: values also from the cost critic, reward also scores the cost (and, as in the PKU
implementation, the cost gets +beta KL where the reward gets -beta KL), advantages combine the two
unwhitened GAEs, the critic update also trains the cost critic."""

from __future__ import annotations

from hybridflow.algorithms import add_kl_to_costs, compute_safe_rlhf_advantages, update_lagrange_multiplier
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.base import score_batch
from hybridflow.trainers.ppo import PPOTrainer
from hybridflow.workers import RuleReward, token_level


class SafeRLHFTrainer(PPOTrainer):
    name = "safe_rlhf"
    spec = ALGORITHM_SPECS["safe_rlhf"]  # a cost (rule or cost model) is required: validation says so

    def __init__(self, config, placement=None, groups=None):
        super().__init__(config, placement, groups)
        s = self.cfg.algorithm.safe_rlhf
        self.lagrange = s.lambda_init
        self.rule_cost = RuleReward(self.cfg.reward, fn=s.cost_fn) if s.cost_fn else None

    def values(self, batch: Batch) -> Batch:
        return super().values(batch).union(self.groups["cost_critic"].compute_values(batch))

    def reward(self, batch: Batch) -> Batch:
        batch = super().reward(batch)
        batch["costs"] = score_batch(batch, self.rule_cost, self.groups.get("cost"), "cost_scores")[0]
        kl_penalty = (
            batch["token_level_scores"] - batch["token_level_rewards"]
        )  # beta KL_t, 0 without kl.in_reward
        batch["token_level_costs"] = add_kl_to_costs(
            token_level(batch["costs"], batch["response_mask"]), kl_penalty
        )
        return batch

    def compute_advantages(self, batch: Batch) -> Batch:
        s, a = self.cfg.algorithm.safe_rlhf, self.cfg.algorithm
        mean_cost = float(batch["costs"].mean())
        self.lagrange = min(
            s.lambda_max, update_lagrange_multiplier(self.lagrange, mean_cost, s.cost_limit, s.lambda_lr)
        )
        batch["advantages"], batch["returns"], batch["cost_returns"] = compute_safe_rlhf_advantages(
            batch["token_level_rewards"], batch["values"], batch["token_level_costs"], batch["cost_values"],
            batch["response_mask"], self.lagrange, a.gamma, a.lam,
        )  # fmt: skip
        self.metrics.update({"safe_rlhf/lambda": self.lagrange, "safe_rlhf/cost_mean": mean_cost,
                             "safe_rlhf/cost_limit": s.cost_limit})  # fmt: skip
        return batch

    def update_critic(self, batch: Batch) -> None:
        super().update_critic(batch)
        self.metrics.update(self.groups["cost_critic"].update_critic(batch))

    def extra_state(self) -> dict:
        return {**super().extra_state(), "lagrange": self.lagrange}

    def load_extra_state(self, state: dict) -> None:
        super().load_extra_state(state)
        self.lagrange = float(state.get("lagrange", self.lagrange))

    def close(self) -> None:
        if self.rule_cost is not None:
            self.rule_cost.close()
        super().close()
