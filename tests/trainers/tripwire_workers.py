"""Role workers whose phase outputs carry a tripwire (a module of its own so Ray workers import it).

Each output of values / reference log-probs / reward model gains a per-row Tripwire that raises if
unpickled in the driver process (tests/controller/workers.py), 128 KiB of payload per row so it lives
in the shared object store, and a pause, so that the busy intervals of phases issued together are
long enough for scheduling on a loaded 2-core machine not to separate them. CountingActor counts its
separate old-log-prob forwards.
"""

from __future__ import annotations

import time

import torch

from hybridflow.controller import Protocol, register
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
from tests.controller.workers import Tripwire

PAUSE_S = 0.3


def _trip(out, name: str, driver_pid: int):
    time.sleep(PAUSE_S)
    out[f"trip_{name}"] = [Tripwire(driver_pid) for _ in range(len(out))]
    out[f"payload_{name}"] = torch.zeros(len(out), 32768)
    return out


class DriverPid:
    """Mixin: the role worker takes `driver_pid` (whose process its tripwires refuse) beside its own kwargs."""

    def __init__(self, *args, driver_pid: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.driver_pid = driver_pid


class TripActor(DriverPid, ActorRolloutRefWorker):
    @register(Protocol.THREE_D, layout="ref")
    def compute_ref_log_prob(self, batch):
        return _trip(super().compute_ref_log_prob(batch), "ref", self.driver_pid)


class TripCritic(DriverPid, CriticWorker):
    @register(Protocol.THREE_D)
    def compute_values(self, batch):
        return _trip(super().compute_values(batch), "values", self.driver_pid)


class TripReward(DriverPid, RewardModelWorker):
    @register(Protocol.THREE_D)
    def compute_reward(self, batch):
        return _trip(super().compute_reward(batch), "reward", self.driver_pid)


TRIP_CLASSES = {ActorRolloutRefWorker: TripActor, CriticWorker: TripCritic, RewardModelWorker: TripReward}


class CountingActor(ActorRolloutRefWorker):
    """Counts its compute_log_prob calls (tests/trainers/test_old_log_probs.py: which steps ran a separate
    forward for the old log-probs)."""

    log_prob_calls = 0

    @register(Protocol.THREE_D, layout="train")
    def compute_log_prob(self, batch):
        self.log_prob_calls += 1
        return super().compute_log_prob(batch)

    @register(Protocol.ONE_TO_ALL)
    def count_log_prob_calls(self) -> int:
        return self.log_prob_calls
