"""GRPO (Shao et al. 2024): PPO without a critic; each prompt gets rollout.n samples and a sample's
advantage is its score normalised within its group (Dr. GRPO with algorithm.norm_by_std=false).
Usually paired with the KL *loss* (algorithm.use_kl_loss) instead of KL in the reward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms import compute_grpo_advantages
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.ppo import PPOTrainer

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import AlgorithmConfig


def grpo_advantages(batch: Batch, algo: AlgorithmConfig, state: dict) -> dict:
    """Each sample's score against its prompt's group (centred, over the std unless Dr. GRPO)."""
    batch["advantages"], batch["returns"] = compute_grpo_advantages(
        batch["token_level_rewards"], batch["uid"], batch["response_mask"], algo.norm_by_std
    )
    return {}


class GRPOTrainer(PPOTrainer):
    name = "grpo"
    spec = ALGORITHM_SPECS["grpo"]
    advantage_fn = staticmethod(grpo_advantages)
