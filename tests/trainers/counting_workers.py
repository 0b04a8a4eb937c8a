"""Role workers that count their frozen-model calls (a module of its own so Ray workers import it): which
processes ran the reference and the reward model, read back with `group.execute_all("scoring_calls")`."""

from __future__ import annotations

from hybridflow.controller import Protocol, register
from hybridflow.workers import ActorRolloutRefWorker, RewardModelWorker


class _Counts:
    def scoring_calls(self) -> int:
        return self.__dict__.get("_scoring_calls", 0)

    def _count(self) -> None:
        self._scoring_calls = self.scoring_calls() + 1


class CountingActor(_Counts, ActorRolloutRefWorker):
    @register(Protocol.THREE_D, layout="ref")
    def compute_ref_log_prob(self, batch):
        self._count()
        return super().compute_ref_log_prob(batch)


class CountingReward(_Counts, RewardModelWorker):
    @register(Protocol.THREE_D)
    def compute_reward(self, batch):
        self._count()
        return super().compute_reward(batch)


COUNTING_CLASSES = {ActorRolloutRefWorker: CountingActor, RewardModelWorker: CountingReward}
