"""REINFORCE++ (Hu 2025): PPO without a critic; the advantage is the discounted reward-to-go
(KL-shaped per token when algorithm.kl.in_reward) whitened over the whole batch."""

from __future__ import annotations

from hybridflow.algorithms import compute_reinforce_pp_advantages
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.ppo import PPOTrainer


class ReinforcePPTrainer(PPOTrainer):
    name = "reinforce_pp"
    spec = ALGORITHM_SPECS["reinforce_pp"]

    def compute_advantages(self, batch: Batch) -> Batch:
        batch["advantages"], batch["returns"] = compute_reinforce_pp_advantages(
            batch["token_level_rewards"], batch["response_mask"], self.cfg.algorithm.gamma
        )
        return batch
