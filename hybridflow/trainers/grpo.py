"""GRPO (Shao et al. 2024): PPO without a critic; each prompt gets rollout.n samples and a sample's
advantage is its score normalised within its group (Dr. GRPO with algorithm.norm_by_std=false).
Usually paired with the KL *loss* (algorithm.use_kl_loss) instead of KL in the reward."""

from __future__ import annotations

from hybridflow.algorithms import compute_grpo_advantages
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.ppo import PPOTrainer


class GRPOTrainer(PPOTrainer):
    name = "grpo"
    spec = ALGORITHM_SPECS["grpo"]

    def compute_advantages(self, batch: Batch) -> Batch:
        batch["advantages"], batch["returns"] = compute_grpo_advantages(
            batch["token_level_rewards"], batch["uid"], batch["response_mask"], self.cfg.algorithm.norm_by_std
        )
        return batch
