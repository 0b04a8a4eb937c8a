"""Worker classes used by the controller tests (a module of its own so Ray workers can import it)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Protocol, Worker, register


class EchoWorker(Worker):
    """Tags every row with the rank that saw it; checks the process group is real with an all_reduce."""

    def __init__(self, scale: float = 1.0, tp: int = 1, pp: int = 1):
        self.scale = scale
        self.mesh = self.build_device_mesh(pp=pp, tp=tp)
        # Rollout layout: replicas of tp ranks each; here generation tp = 1, so every rank is a replica
        # whose micro-DP index is its tp rank inside the training group.
        self.set_layout("rollout", dp_rank=self.rank, dp_size=self.world_size)

    def _tag(self, batch: Batch) -> Batch:
        ones = torch.ones(1)
        dist.all_reduce(ones)  # a real collective over the group: sums to world size
        out = Batch(dict(batch.tensors), dict(batch.non_tensors), dict(batch.meta))
        out["y"] = batch["x"] * self.scale
        out["rank"] = torch.full((len(batch),), self.rank)
        out["world"] = torch.full((len(batch),), int(ones.item()))
        return out

    @register(Protocol.DP_PROTO)
    def dp(self, batch: Batch) -> Batch:
        return self._tag(batch)

    @register(Protocol.THREE_D)
    def three_d(self, batch: Batch) -> Batch:
        return self._tag(batch)

    @register(Protocol.THREE_D_ALL_MICRO_DP)
    def micro_dp(self, batch: Batch) -> Batch:
        return self._tag(batch)

    @register(Protocol.DP_PROTO, blocking=False)
    def dp_async(self, batch: Batch) -> Batch:
        return self._tag(batch)

    @register(Protocol.ONE_TO_ALL)
    def info(self, x=None) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "x": x, "device": str(self.device)}

    @register(Protocol.ALL_TO_ALL)
    def per_rank(self, x):
        return (self.rank, x)

    @register(Protocol.RANK_ZERO)
    def only_zero(self):
        return self.rank

    @register(Protocol.THREE_D_PP_ONLY)
    def pp_stage(self):
        lay = self.get_layout("train")
        return (lay.pp_rank, lay.dp_rank, lay.tp_rank, self.rank)

    @register(Protocol.DP_METRICS)
    def metrics(self, batch: Batch) -> dict:
        return {"loss": float(batch["x"].sum()), "n/sum": len(batch), "rank/max": self.rank}

    @register(Protocol.ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        t0 = time.time()
        time.sleep(seconds)
        return t0
