"""The synchronous source: the paper's schedule. Each step's batch is generated from the current
weights on the actor's own ranks (the 3D-HybridEngine switches them from training to generation and
back, workers/actor.py), so it is on policy (lag 0) and no other pool or weight sync exists."""

from __future__ import annotations

from hybridflow.batch import Batch
from hybridflow.trainers.sources.base import RolloutSource, StepBatch


class SynchronousSource(RolloutSource):
    def batch(self, prompts: Batch) -> StepBatch:
        step = int(prompts.meta["global_step"])
        restored = self.take_in_flight(step)  # a one-step-ahead run's checkpoint, resumed synchronously
        if restored is not None:
            lag = step - 1 - restored.version
            return self.step_batch(
                restored.rollouts, prompts, {r: [b] for r, b in restored.frozen.items()}, lag, {}
            )
        return self.step_batch(self.trainer.actor.generate_sequences(prompts), prompts, {}, 0, {})
