"""A GPU rank's device facts, below the engines so engines, rollout and hybrid_engine share them: which
CUDA device the rank's process computes on, a clock that waits for the device, and the process's one
DeviceMesh per shape.

- `cuda_index`: Ray restricts a GPU actor to its own GPU through CUDA_VISIBLE_DEVICES, where the device
  is cuda:0; a process that sees several GPUs (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, a node started
  with its own CUDA_VISIBLE_DEVICES list) must find its GPU's place in that list, or every rank lands on
  cuda:0.
- `device_clock`: CUDA kernels and NCCL collectives return to Python before they run, so a clock read
  right after them times the launch, not the work.
- `process_mesh`: every `init_device_mesh` call creates new process groups (NCCL communicators, each with
  its own device buffers), so each engine of each colocated role building its own mesh multiplies them;
  roles of one process share the groups of one mesh per shape instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def cuda_index(visible: str | None, assigned: Sequence, local_rank: int) -> int:
    """The CUDA device index of a rank's GPU.

    visible: the process's CUDA_VISIBLE_DEVICES (None or "" = every GPU of the node, in the node's order);
    assigned: the GPU ids Ray gave the process (ray.get_gpu_ids(): the node's ids, as its
    CUDA_VISIBLE_DEVICES listed them when the node started); local_rank: the rank among its group's
    processes on the node, used only when Ray assigned no GPU (processes started outside Ray's GPU
    accounting, one per GPU in local-rank order).
    """
    if not assigned:
        return local_rank
    gpu = str(assigned[0]).strip()
    if not visible:
        return int(gpu)
    order = [v.strip() for v in visible.split(",")]
    if gpu not in order:
        raise RuntimeError(
            f"Ray assigned GPU {gpu} but this process's CUDA_VISIBLE_DEVICES is {visible!r}; "
            "start the node with the GPUs its processes may see"
        )
    return order.index(gpu)


def device_clock(device: str | torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """`clock()` once the work queued on `device` has finished. Read it before and after device work to
    time the work itself: on CUDA it synchronises the device first (so the time before the first read is
    not counted either); CPU work, the strict stand-in's included, has run when its call returns."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock()


_MESHES: dict[tuple, tuple[object, object]] = {}  # (device type, shape, names) -> (default group, mesh)


def process_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """The DeviceMesh of this shape over the default process group, built once per process and group.

    Every rank of a worker group builds its roles' meshes in the same order (SPMD), so all ranks find
    the same mesh here or all create it: the collective group creation stays matched. A new default
    group (a test re-initialising torch.distributed) gets new meshes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    key, group = (device_type, tuple(shape), tuple(names)), dist.group.WORLD
    cached = _MESHES.get(key)
    if cached is not None and cached[0] is group:
        return cached[1]
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    _MESHES[key] = (group, mesh)
    return mesh
