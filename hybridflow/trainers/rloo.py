"""RLOO (Ahmadian et al. 2024): PPO without a critic; the baseline of each sample is the mean score
of the other samples of its prompt (rollout.n >= 2)."""

from __future__ import annotations

from hybridflow.algorithms import compute_rloo_advantages
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.ppo import PPOTrainer


def rloo_advantages(batch: Batch, algo, state: dict) -> dict:
    """Each sample's score against the mean of the other samples of its prompt."""
    batch["advantages"], batch["returns"] = compute_rloo_advantages(
        batch["token_level_rewards"], batch["uid"], batch["response_mask"]
    )
    return {}


class RLOOTrainer(PPOTrainer):
    name = "rloo"
    spec = ALGORITHM_SPECS["rloo"]
    advantage_fn = staticmethod(rloo_advantages)
