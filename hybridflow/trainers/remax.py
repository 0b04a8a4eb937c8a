"""ReMax (Li et al. 2023): PPO without a critic; one extra *greedy* generation per prompt is scored
and its reward is the baseline of that prompt's sampled responses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms import compute_remax_advantages
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.ppo import PPOTrainer

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import AlgorithmConfig


def remax_advantages(batch: Batch, algo: AlgorithmConfig, state: dict) -> dict:
    """The reward-to-go less the greedy response's score."""
    batch["advantages"], batch["returns"] = compute_remax_advantages(
        batch["token_level_rewards"], batch["reward_baselines"], batch["response_mask"]
    )
    return {}


class ReMaxTrainer(PPOTrainer):
    name = "remax"
    spec = ALGORITHM_SPECS["remax"]
    advantage_fn = staticmethod(remax_advantages)

    def generate(self, prompts: Batch) -> Batch:
        batch = super().generate(prompts)
        with self.timers("gen_baseline"):
            greedy = self.actor.generate_sequences(prompts, sampling={"n": 1, "temperature": 0.0})
            baseline = self.score(greedy)[0]
        batch["reward_baselines"] = baseline.repeat_interleave(len(batch) // len(prompts))
        return batch
