"""RLOO (Ahmadian et al. 2024): PPO without a critic; the baseline of each sample is the mean score
of the other samples of its prompt (rollout.n >= 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms import compute_rloo_advantages
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.ppo import PPOTrainer

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import AlgorithmConfig


def rloo_advantages(batch: Batch, algo: AlgorithmConfig, state: dict) -> dict:
    """Each sample's score against the mean of the other samples of its prompt."""
    batch["advantages"], batch["returns"] = compute_rloo_advantages(
        batch["token_level_rewards"], batch["uid"], batch["response_mask"]
    )
    return {}


class RLOOTrainer(PPOTrainer):
    name = "rloo"
    spec = ALGORITHM_SPECS["rloo"]
    advantage_fn = staticmethod(rloo_advantages)
