"""The device mesh of a worker group: a ("dp", "tp") DeviceMesh over the default process group, or
("pp", "dp", "tp") with pipeline stages (pp > 1).

Layout: tp is the fastest-varying axis, so consecutive ranks form a TP group (the paper's
convention: with 8 ranks and tp=4, TP groups are [0-3] and [4-7]); pp the slowest, so the first dp * tp
ranks run stage 0. gloo on CPU, NCCL on GPU: the backend is whatever the default
group was initialised with (`init_process_group`), usually by the worker group. The engines of a
process (an actor's and its reference's, colocated roles') share one mesh per shape and so one set of
process groups (controller/device.py process_mesh).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridflow.controller.device import process_mesh
from hybridflow.engines.config import ParallelConfig


def build_mesh(parallel: ParallelConfig, device_type: str = "cpu") -> DeviceMesh | None:
    """A ("dp", "tp") mesh (("pp", "dp", "tp") when pp > 1) over the default group, or None when no process group is initialised
    (single-process use: the model then runs unsharded). device_type: the engine's device ("cpu" / "cuda"),
    the one its worker was given."""
    parallel.check()
    if not dist.is_available() or not dist.is_initialized():
        if parallel.world_size != 1:
            raise RuntimeError(
                f"ParallelConfig(tp={parallel.tp}, dp={parallel.dp}) needs {parallel.world_size} ranks but no "
                "process group is initialised; call torch.distributed.init_process_group first"
            )
        return None
    world = dist.get_world_size()
    if world != parallel.world_size:
        raise ValueError(
            f"ParallelConfig(tp={parallel.tp}, pp={parallel.pp}, dp={parallel.dp}) covers {parallel.world_size} "
            f"ranks but the process group has {world}; make tp * pp * dp equal the world size"
        )
    if parallel.pp > 1:
        shape, names = (parallel.pp, parallel.dp, parallel.tp), ("pp", "dp", "tp")
        return process_mesh(device_type, shape, names)
    return process_mesh(device_type, (parallel.dp, parallel.tp), ("dp", "tp"))
