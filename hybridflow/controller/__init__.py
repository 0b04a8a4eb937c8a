"""The single controller's machinery (docs/design.md §3): resource pools, SPMD worker groups, transfer protocols.

Files, in the order data flows through them:
    resource_pool.py  ResourcePool: devices reserved as a Ray placement group, ranks ordered by node
    worker.py         Worker base class: rank/device, named mesh layouts, DeviceMesh helper
    layout.py         Layout / ShardPlan and the one padding+splitting rule (shard_indices)
    protocols.py      @register, the transfer protocols (distribute, collect), register_protocol
    worker_group.py   WorkerGroup / create_colocated_groups: processes, method binding, dispatch
    process.py        WorkerProcess: the Ray actor per rank; resolves shards and futures worker-side
    device.py         a GPU rank's CUDA index, a clock that waits for its device, one DeviceMesh per shape
    future.py         Future / get: non-blocking calls, passed between groups without the driver
    errors.py         WorkerError / WorkerDiedError / WorkerHungError: failures named by group, rank and method
    strict_device.py  device-strict mode: GPU-only placement bugs (host tensors on the device path) fail on CPU
"""

from hybridflow.controller.errors import WorkerDiedError, WorkerError
from hybridflow.controller.future import Future, get
from hybridflow.controller.layout import Layout, ShardPlan, shard_indices
from hybridflow.controller.protocols import (
    GroupView,
    Protocol,
    reduce_metrics,
    register,
    register_protocol,
)
from hybridflow.controller.resource_pool import ResourcePool, ensure_ray, share_cpus
from hybridflow.controller.worker import Worker, WorkerContext, local_worker_context
from hybridflow.controller.worker_group import WorkerGroup, create_colocated_groups

__all__ = [
    "Future",
    "GroupView",
    "Layout",
    "Protocol",
    "ResourcePool",
    "ShardPlan",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerError",
    "WorkerGroup",
    "create_colocated_groups",
    "ensure_ray",
    "get",
    "local_worker_context",
    "reduce_metrics",
    "register",
    "register_protocol",
    "shard_indices",
    "share_cpus",
]
