"""Rollout sources: where the RL driver's batches come from (base.py says what a source is).

base.py          the interface, its typed state, and the synchronous source: generate on the actor's own
                 ranks each step (trainer.rollout_ahead=0)
ahead.py         step k+1 generated on a rollout pool of its own during step k (trainer.rollout_ahead=1)
"""

from __future__ import annotations

from hybridflow.trainers.sources.ahead import OneStepAheadSource
from hybridflow.trainers.sources.base import (
    InFlight,
    OldLogProbs,
    RolloutSource,
    StepBatch,
    SynchronousSource,
    old_log_prob_source,
)

# trainer.rollout_ahead -> the source that runs that schedule
SOURCES: dict[int, type[RolloutSource]] = {0: SynchronousSource, 1: OneStepAheadSource}


def source_class(cfg) -> type[RolloutSource]:
    """The source class of the config's schedule (its `roles` are known before any group starts)."""
    return SOURCES[cfg.trainer.rollout_ahead]


__all__ = [
    "SOURCES",
    "InFlight",
    "OldLogProbs",
    "OneStepAheadSource",
    "RolloutSource",
    "StepBatch",
    "SynchronousSource",
    "old_log_prob_source",
    "source_class",
]
