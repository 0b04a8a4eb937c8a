"""REINFORCE++ (Hu 2025): PPO without a critic; the advantage is the discounted reward-to-go
(KL-shaped per token when algorithm.kl.in_reward) whitened over the whole batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms import compute_reinforce_pp_advantages
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.ppo import PPOTrainer

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import AlgorithmConfig


def reinforce_pp_advantages(batch: Batch, algo: AlgorithmConfig, state: dict) -> dict:
    """The discounted reward-to-go, whitened over the batch."""
    batch["advantages"], batch["returns"] = compute_reinforce_pp_advantages(
        batch["token_level_rewards"], batch["response_mask"], algo.gamma
    )
    return {}


class ReinforcePPTrainer(PPOTrainer):
    name = "reinforce_pp"
    spec = ALGORITHM_SPECS["reinforce_pp"]
    advantage_fn = staticmethod(reinforce_pp_advantages)
