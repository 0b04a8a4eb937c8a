"""Worker classes used by the controller tests (a module of its own so Ray workers can import it)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hybridflow.batch import Batch
from hybridflow.controller import Protocol, Worker, register, register_protocol


class EchoWorker(Worker):
    """Tags every row with the rank that saw it; checks the process group is real with an all_reduce."""

    def __init__(self, scale: float = 1.0, tp: int = 1, pp: int = 1, tg: int = 1):
        self.scale = scale
        self.mesh = self.build_device_mesh(pp=pp, tp=tp)
        # Rollout layout as in docs/design.md §4: generation tp groups of size tg are strided (e.g. [0,2],[1,3]),
        # each group is one replica, collected from its first rank.
        replicas = self.world_size // tg
        self.set_layout(
            "rollout",
            dp_rank=self.rank % replicas,
            dp_size=replicas,
            tp_rank=self.rank // replicas,
            tp_size=tg,
        )

    def _tag(self, batch: Batch) -> Batch:
        ones = torch.ones(1)
        dist.all_reduce(ones)  # a real collective over the group: sums to world size
        self.last_input = batch["x"].clone()
        out = Batch(dict(batch.tensors), dict(batch.non_tensors), batch.meta.copy())
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
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "x": x,
            "device": str(self.device),
            "node": self.context.node_id,
        }

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


# ---- extras for the future / error / protocol tests ------------------------------------------
def _load_tripwire(forbidden_pid: int):
    if os.getpid() == forbidden_pid:
        raise RuntimeError("the driver deserialised a batch it should only have routed")
    return Tripwire(forbidden_pid)


class Tripwire:
    """A per-sample object that refuses to be unpickled in one process (the driver)."""

    def __init__(self, forbidden_pid: int):
        self.forbidden_pid = forbidden_pid

    def __reduce__(self):
        return (_load_tripwire, (self.forbidden_pid,))


def publish_rows(batch: Batch) -> Batch:
    """For Worker.apply: the batch unchanged, its size and this process's pid published to the driver."""
    batch.meta.call_info = {"rows": len(batch), "pid": os.getpid()}
    return batch


def _last_rank_only(view, args, kwargs):
    return [None] * (view.world_size - 1) + [(args, kwargs)]


register_protocol("TEST_LAST_RANK", _last_rank_only, lambda view, outs: outs[-1], overwrite=True)


class DataWorker(EchoWorker):
    """EchoWorker plus producer/consumer methods for futures, failures and a user protocol."""

    @register(Protocol.DP_PROTO, blocking=False)
    def produce(self, batch: Batch, driver_pid: int, payload: int) -> Batch:
        out = self._tag(batch)
        out["payload"] = torch.zeros(len(batch), payload)  # large enough for the shared object store
        out["trip"] = [Tripwire(driver_pid) for _ in range(len(batch))]
        return out

    @register(Protocol.DP_PROTO)
    def consume(self, batch: Batch) -> Batch:
        if "trip" in batch:
            assert all(isinstance(t, Tripwire) for t in batch["trip"])
        self.last_input = batch["x"].clone()
        return Batch({"x": batch["x"], "consumer_rank": torch.full((len(batch),), self.rank)})

    @register(Protocol.THREE_D)
    def consume_3d(self, batch: Batch) -> Batch:
        return self.consume(batch)

    @register(Protocol.DP_PROTO)
    def repeat_rows(self, batch: Batch) -> Batch:
        return self._tag(batch).repeat(2, interleave=True)

    @register(Protocol.ONE_TO_ALL)
    def last_x(self):
        return self.last_input.tolist()

    @register(Protocol.ONE_TO_ALL, blocking=False)
    def sleep_async(self, seconds: float) -> tuple[float, float]:
        t0 = time.time()
        time.sleep(seconds)
        return t0, time.time()

    @register(Protocol.ONE_TO_ALL)
    def fail_on(self, rank: int):
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.rank

    @register(Protocol.ONE_TO_ALL)
    def fail_in_collective(self, rank: int):
        if self.rank == rank:
            raise ValueError("boom before the all_reduce")
        dist.all_reduce(torch.ones(1))  # the other ranks wait here for the failed one

    @register(Protocol.ONE_TO_ALL)
    def die(self, rank: int):
        if self.rank == rank:
            os._exit(3)
        return self.rank

    @register(Protocol.ONE_TO_ALL)
    def second_engine_mesh(self, tp: int) -> tuple[int, bool]:
        """Two engines of one parallel shape in this process (an actor and its reference): (process
        groups the second one's mesh created, whether it is the first one's mesh)."""
        from torch.distributed.distributed_c10d import _world

        from hybridflow.engines import ParallelConfig, build_mesh

        parallel = ParallelConfig(tp=tp, dp=self.world_size // tp)
        first = build_mesh(parallel)
        before = len(_world.pg_map)
        second = build_mesh(parallel)
        return len(_world.pg_map) - before, second is first

    @register("TEST_LAST_RANK")
    def whoami(self, tag: str):
        return f"{tag}:{self.rank}"


class FailingInit(Worker):
    def __init__(self):
        if self.rank == 0:
            raise RuntimeError("cannot build on rank 0")
