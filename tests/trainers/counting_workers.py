"""Role workers that count their frozen-model calls and rows (a module of its own so Ray workers import it):
which processes ran the reference and the reward model, read back with `group.execute_all("scoring_calls")`
(and "scored_rows")."""

from __future__ import annotations

from hybridflow.controller import Protocol, register
from hybridflow.workers import ActorRolloutRefWorker, RewardModelWorker


class _Counts:
    def scoring_calls(self) -> int:
        return self.__dict__.get("_scoring_calls", 0)

    def scored_rows(self) -> int:
        return self.__dict__.get("_scored_rows", 0)

    def _count(self, batch) -> None:
        self._scoring_calls = self.scoring_calls() + 1
        self._scored_rows = self.scored_rows() + len(batch)


class CountingActor(_Counts, ActorRolloutRefWorker):
    @register(Protocol.THREE_D, layout="ref")
    def compute_ref_log_prob(self, batch):
        self._count(batch)
        return super().compute_ref_log_prob(batch)


class CountingReward(_Counts, RewardModelWorker):
    @register(Protocol.THREE_D)
    def compute_reward(self, batch):
        self._count(batch)
        return super().compute_reward(batch)


COUNTING_CLASSES = {ActorRolloutRefWorker: CountingActor, RewardModelWorker: CountingReward}
