"""WorkerProcess: the Ray actor behind one rank of a worker group (one process per device).

It owns the torch.distributed membership and hosts one or more Worker instances ("roles"), so
colocated roles share the process, the device and the process group. Every group call arrives as
`execute(role, method, args, kwargs)`, which

1. resolves argument placeholders *inside the worker*: a shard the driver put in the object store,
   or a slice of another group's outputs (a future) cut out here, so the data never passes through
   the driver;
2. calls the method;
3. drops the rows produced by padding (the driver padded the batch to a multiple of the dp size; the
   method itself sees the count in `batch.meta.pad_rows`, so training can mask those rows out);
4. returns (CallInfo, output) as two objects (num_returns=2), so the driver learns the output's
   size, the method's start/end wall-clock stamps (docs/metrics.md: each phase's busy time) and
   the small values a Batch output publishes in meta.call_info, all without fetching the output.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from hybridflow.batch import Batch
from hybridflow.controller import strict_device
from hybridflow.controller.device import cuda_index, device_clock
from hybridflow.controller.layout import shard_indices
from hybridflow.controller.worker import WorkerContext, set_worker_context


@dataclass(frozen=True)
class CallInfo:
    """What the driver learns of one rank's call without fetching its output.

    rows: the output's row count (Batch outputs; None otherwise), for consumers cutting shards.
    start / end: wall-clock seconds (time.time()) around the method itself, after its arguments
    were resolved, each read once the rank's device is idle (a GPU method returns before its kernels
    have run): the rank's busy interval, comparable across processes of one machine.
    info: what the method put in its output Batch's meta.call_info (small: metrics), or None.
    """

    rows: int | None
    start: float
    end: float
    info: dict | None = None


@dataclass(frozen=True)
class PutShard:
    """A shard the driver put in the object store once (shared by all ranks of a tp/pp group)."""

    ref: list  # [ObjectRef], nested so Ray does not resolve it before the call
    pad: int


@dataclass(frozen=True)
class FutureShard:
    """Shard `shard` of `n_shards` of another call's collected outputs, cut out by the consumer.

    size_refs / out_refs: the producer's collected ranks in shard order (sizes are CallInfos).
    n_shards = 0 means "the whole output" (a broadcast of a future). rows: only rows [lo, hi) of the
    output are sharded (Future.rows), None = all of them.
    """

    size_refs: list
    out_refs: list
    shard: int
    n_shards: int
    rows: tuple[int, int] | None = None


def resolve(arg):
    """-> (value, pad rows) for placeholders; (arg, 0) for anything else."""
    if isinstance(arg, PutShard):
        return ray.get(arg.ref[0]), arg.pad
    if isinstance(arg, FutureShard):
        return _resolve_future_shard(arg)
    return arg, 0


def _resolve_future_shard(f: FutureShard) -> tuple[Batch, int]:
    sizes = [c.rows for c in ray.get(f.size_refs)]
    if any(s is None for s in sizes):
        raise TypeError("a future passed on as a batch must come from a method returning a Batch")
    offsets = np.cumsum([0, *sizes])
    lo, hi = f.rows or (0, int(offsets[-1]))
    if not 0 <= lo <= hi <= offsets[-1]:
        raise IndexError(f"rows [{lo}, {hi}) of a call's output of {int(offsets[-1])} rows")
    total = hi - lo
    if f.n_shards == 0:
        rows, pad = slice(0, total), 0
    else:
        rows, pad = shard_indices(total, f.n_shards, f.shard)
    idx = lo + (np.arange(total)[rows] if isinstance(rows, slice) else rows)
    if len(idx) == 0:
        return ray.get(f.out_refs[0]).index(slice(0, 0)), 0
    owner = np.searchsorted(offsets, idx, side="right") - 1  # producer shard holding each row
    needed = sorted(set(owner.tolist()))
    parts = dict(zip(needed, ray.get([f.out_refs[i] for i in needed])))
    pieces, start = [], 0
    # Consecutive rows from the same producer shard become one slice (a view, no copy).
    while start < len(idx):
        p = owner[start]
        stop = start
        while stop < len(idx) and owner[stop] == p and idx[stop] == idx[start] + (stop - start):
            stop += 1
        at = int(idx[start] - offsets[p])
        pieces.append(parts[p].index(slice(at, at + stop - start)))
        start = stop
    out = pieces[0] if len(pieces) == 1 else Batch.concat(pieces)
    return out, pad


def drop_padding(output, n_in: int, pad: int, method: str):
    """Drop the output rows that padding rows produced (proportionally: k output rows per input row)."""
    if not pad or n_in == 0:
        return output
    if isinstance(output, Batch):
        output.meta.pad_rows = 0  # an output's meta may be copied from its input's
    if isinstance(output, (Batch, torch.Tensor, list)):
        n_out = len(output)
        if (n_out * pad) % n_in:
            raise ValueError(
                f"{method}: returned {n_out} rows for an input of {n_in} rows ({pad} of them padding); "
                "cannot tell which output rows are padding — return a whole multiple of the input rows"
            )
        keep = n_out - n_out * pad // n_in
        if isinstance(output, Batch):
            return output.index(slice(0, keep))
        return output[:keep]
    return output  # e.g. a metrics dict: training methods mask padding rows out (workers/common.py)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_threads(cpu_ranks: int, use_gpu: bool) -> int:
    """Intra-op threads for this rank.

    Ray sets OMP_NUM_THREADS=1 in actors that hold a fraction of a CPU, which would leave a laptop's
    other cores idle in a one-process run. So on CPU a rank takes its share of the node's cores among
    the `cpu_ranks` ranks that can compute at the same time there (cores // cpu_ranks, at least 1):
    a pool's own ranks on the node, plus those of the pools running beside it (split placement, the
    rollout pool: resource_pool.share_cpus). Without that, two pools of one rank each would both take
    every core and oversubscribe the machine whenever they overlap. HYBRIDFLOW_CPU_THREADS overrides
    (tests pin it to 1 so results do not depend on the machine). GPU ranks need few CPU threads:
    OMP_NUM_THREADS, default 1.
    """
    if os.environ.get("HYBRIDFLOW_CPU_THREADS"):
        return max(1, int(os.environ["HYBRIDFLOW_CPU_THREADS"]))
    if use_gpu:
        return int(os.environ.get("OMP_NUM_THREADS", "1"))
    return max(1, usable_cores() // max(1, cpu_ranks))


class WorkerProcess:
    """One rank's process. Created by WorkerGroup through ray.remote(...).options(placement)."""

    def __init__(
        self, group_name: str, rank: int, world_size: int, local_rank: int, use_gpu: bool, cpu_ranks: int,
        strict: bool = False,
    ):  # fmt: skip
        torch.set_num_threads(cpu_threads(cpu_ranks, use_gpu))
        self.group_name, self.rank, self.world_size = group_name, rank, world_size
        self.local_rank, self.use_gpu = local_rank, use_gpu
        # device-strict mode (strict_device.py): a CPU rank stands in for a GPU, so GPU-only placement bugs fail
        self.strict = strict and not use_gpu
        self.device = "cpu"  # the rank's device once init_distributed has chosen it
        self.roles: dict[str, object] = {}

    def master_address(self) -> tuple[str, int]:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_distributed(self, addr: str, port: int, timeout_s: float) -> int:
        import datetime

        import torch.distributed as dist

        device = str(strict_device.ACCEL) if self.strict else "cpu"
        if self.use_gpu:  # the GPU Ray assigned: cuda:0 unless this process sees several (cuda_index)
            index = cuda_index(os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get_gpu_ids(), self.local_rank)
            torch.cuda.set_device(index)
            device = f"cuda:{index}"
        self.device = device
        backend = "nccl" if self.use_gpu else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.rank == 0:  # the rendezvous store listens on the node's address only, not on every interface
            self._store_socket = socket.create_server((addr, port), backlog=1024)
            store = dist.TCPStore(addr, port, self.world_size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=self._store_socket.fileno())  # fmt: skip
        else:
            store = dist.TCPStore(addr, port, self.world_size, False, timeout)
        # device_id binds the NCCL group to this rank's GPU and creates its communicator now, so the
        # meshes' subgroups are split from it (ncclCommSplit) rather than each bootstrapped anew
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout,
            device_id=torch.device(device) if self.use_gpu else None,
        )  # fmt: skip
        node = ray.get_runtime_context().get_node_id()
        ctx = WorkerContext(
            self.group_name, self.rank, self.world_size, self.local_rank, node, device, backend
        )
        set_worker_context(ctx)
        return os.getpid()

    def add_role(self, role: str, cls, kwargs: dict) -> None:
        with strict_device.strict_scope(self.strict):
            self.roles[role] = cls(**kwargs)

    def get_layouts(self, role: str, name: str | None):
        return self.roles[role].get_layout(name)

    def execute(self, role: str, method: str, args: tuple, kwargs: dict):
        pads = []
        args = tuple(_take(resolve(a), pads) for a in args)
        kwargs = {k: _take(resolve(v), pads) for k, v in kwargs.items()}
        n_in = next((len(a) for a in (*args, *kwargs.values()) if isinstance(a, Batch)), 0)
        start = device_clock(self.device, time.time)
        with strict_device.strict_scope(self.strict):
            if self.strict:  # what arrives through Ray is on the host
                for a in (*args, *kwargs.values()):
                    if isinstance(a, (Batch, torch.Tensor)):
                        strict_device.mark_host(a)
            out = getattr(self.roles[role], method)(*args, **kwargs)
            if self.strict:
                strict_device.check_output(out, f"{self.group_name}.{method}")
        end = device_clock(self.device, time.time)
        out = drop_padding(out, n_in, pads[0] if pads else 0, method)
        if isinstance(out, Batch):
            info, out.meta.call_info = out.meta.call_info, None
            return CallInfo(len(out), start, end, info), out
        return CallInfo(None, start, end), out


def _take(resolved, pads: list):
    value, pad = resolved
    if isinstance(value, Batch):
        pads.append(pad)
        if pad:  # the method sees which rows are padding (training masks them out of every loss)
            value.meta.pad_rows = pad
    return value
