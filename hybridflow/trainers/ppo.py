"""PPO (Ouyang et al. 2022 / the paper's Figure 4 driver): actor, critic, reference, reward.

The loop body is the paper's eight lines: generate, values, reference log-probs, reward, advantages
(GAE), update critic, update actor — plus the old log-probs, which cost no forward when the update is
one optimizer step (sources/base.py old_log_prob_source). Each phase runs inside a named timer
(timing_s/<name>: the busy time of the workers that ran it). The phases are futures (rl.py): values, reference and reward run at the same
time when their groups are on different pools, and so do the critic and actor updates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridflow.algorithms import compute_gae
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.trainers.rl import RLTrainer

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import AlgorithmConfig


def gae_advantages(batch: Batch, algo: AlgorithmConfig, state: dict) -> dict:
    """GAE over the KL-shaped token rewards and the critic's values (whitened advantages)."""
    batch["advantages"], batch["returns"] = compute_gae(
        batch["token_level_rewards"], batch["values"], batch["response_mask"], algo.gamma, algo.lam
    )
    return {}


class PPOTrainer(RLTrainer):
    name = "ppo"
    spec = ALGORITHM_SPECS["ppo"]
    advantage_fn = staticmethod(gae_advantages)

    def train_step(self, batch: Batch) -> tuple[Batch, dict]:
        phase = self.timers.phase
        with phase("gen"):
            batch = self.generate(batch)
        with phase("old_log_prob"):
            batch = self.old_log_probs(batch)
        if self.spec.critic:
            with phase("values"):
                batch = self.values(batch)
        with phase("ref"):
            batch = self.ref_log_probs(batch)
        with phase("reward"):
            batch = self.reward(batch)
        with phase("adv"):
            batch = self.compute_advantages(batch)
        if self.spec.critic:
            with phase("update_critic"):
                self.update_critic(batch)
        with phase("update_actor"):
            self.update_actor(batch)
        return self.finish(batch)
