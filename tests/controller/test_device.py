"""A GPU rank's device facts (hybridflow/controller/device.py), checked on CPU.

- which CUDA device a rank takes when its process sees several GPUs (the pure mapping; the GPU run of
  docs/bench/gpu.md checks the wiring);
- timing waits for the device: a stand-in for CUDA's asynchrony (a launch returns at once, and
  torch.cuda.synchronize waits for the queued work) makes a worker call's busy interval and the
  3D-HybridEngine's collective seconds count that work, as they must on a GPU;
- the engines of one process share one mesh per shape: a second engine's mesh creates no process group.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from hybridflow.controller import device as device_mod
from hybridflow.controller import strict_device
from hybridflow.controller.device import cuda_index, device_clock
from hybridflow.controller.process import WorkerProcess
from hybridflow.hybrid_engine import comm as comm_mod
from hybridflow.hybrid_engine.comm import CountedComm


# ---- which GPU ---------------------------------------------------------------------------------------
def test_cuda_index_under_ray_restriction_is_zero():
    """Ray sets CUDA_VISIBLE_DEVICES to the actor's own GPU: it is cuda:0, whatever its id."""
    assert cuda_index("5", [5], local_rank=3) == 0
    assert cuda_index("GPU-1f2e", ["GPU-1f2e"], local_rank=1) == 0


def test_cuda_index_when_the_process_sees_several_gpus():
    """RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the assigned id's place in the visible list, or the id
    itself when the node exposes every GPU; never cuda:0 for all ranks."""
    assert [cuda_index(None, [gpu], local_rank=0) for gpu in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [cuda_index("", [str(gpu)], local_rank=0) for gpu in (2, 3)] == [2, 3]
    assert [cuda_index("4,5,6,7", [gpu], local_rank=0) for gpu in (4, 5, 6, 7)] == [0, 1, 2, 3]
    assert cuda_index("6, 7", ["7"], local_rank=0) == 1
    assert cuda_index("0,1", [], local_rank=1) == 1  # outside Ray's GPU accounting: one GPU per local rank
    with pytest.raises(
        RuntimeError, match=r"Ray assigned GPU 3 but this process's CUDA_VISIBLE_DEVICES is '0,1'"
    ):
        cuda_index("0,1", [3], local_rank=0)


# ---- timing waits for the device ---------------------------------------------------------------------
class FakeCudaQueue:
    """CUDA's asynchrony, stood in for: `launch` returns at once; torch.cuda.synchronize(device) waits
    until the work queued on that device has run."""

    def __init__(self, monkeypatch):
        self.pending, self.synced = 0.0, []
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def launch(self, seconds: float) -> None:
        self.pending += seconds

    def synchronize(self, device=None) -> None:
        self.synced.append(torch.device(device))
        time.sleep(self.pending)
        self.pending = 0.0


def test_device_clock_waits_for_cuda_work_only(monkeypatch):
    queue = FakeCudaQueue(monkeypatch)
    start = device_clock("cuda:1")
    queue.launch(0.2)
    assert device_clock(torch.device("cuda", 1)) - start >= 0.2
    assert queue.synced == [torch.device("cuda", 1)] * 2
    for host in ("cpu", strict_device.ACCEL):  # CPU work has run when its call returns
        device_clock(host)
    assert len(queue.synced) == 2


class Launcher:
    """A role whose method queues device work and returns, as a GPU training step does."""

    def __init__(self, queue: FakeCudaQueue):
        self.queue = queue

    def step(self, seconds: float) -> dict:
        self.queue.launch(seconds)
        return {"loss": 1.0}


def test_worker_call_busy_time_counts_the_queued_device_work(monkeypatch):
    """timing_s/<phase> is the ranks' busy interval (CallInfo start/end): on a GPU rank it must include the
    kernels its method queued, not only their launch."""
    queue, threads = FakeCudaQueue(monkeypatch), torch.get_num_threads()
    monkeypatch.setenv("HYBRIDFLOW_CPU_THREADS", str(threads))
    proc = WorkerProcess("g", rank=0, world_size=1, local_rank=0, use_gpu=False, cpu_ranks=1)
    proc.device = "cuda:0"  # as init_distributed sets it on a GPU rank
    proc.add_role("actor", Launcher, {"queue": queue})
    info, out = proc.execute("actor", "step", (0.3,), {})
    assert out == {"loss": 1.0} and info.end - info.start >= 0.3
    assert torch.get_num_threads() == threads


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_counted_collectives_read_the_clock_of_their_tensors_device(monkeypatch, one_rank_group):
    """The switch's comm seconds (reshard/*): each collective is timed through device_clock on the device
    its tensors are on, so on a GPU it counts until NCCL finished, not its launch."""
    seen = []

    def clock(device, *args):
        seen.append(torch.device(device))
        return device_clock(device, *args)

    monkeypatch.setattr(comm_mod, "device_clock", clock)
    comm, t = CountedComm(), torch.ones(4)
    comm.all_gather_into(torch.empty(4), t, one_rank_group)
    comm.broadcast(t, src=0, group=one_rank_group)
    comm.gather(t, torch.empty(4), dst=0, group=one_rank_group)
    assert seen == [torch.device("cpu")] * 6 and comm.stats.calls == 3


# ---- one mesh per shape --------------------------------------------------------------------------------
def test_second_engine_of_a_shape_creates_no_process_group(groups2):
    """An actor and its reference engine (or colocated roles) in one process: the second engine's (dp, tp)
    mesh is the first's, so its subgroups (NCCL communicators on a GPU) exist once per process."""
    g = groups2["dp"]
    assert g.second_engine_mesh(tp=2) == [(0, True)] * g.world_size
    assert g.second_engine_mesh(tp=1) == [(0, True)] * g.world_size


def test_process_mesh_follows_a_new_default_group(one_rank_group):
    first = device_mod.process_mesh("cpu", (1, 1), ("dp", "tp"))
    assert device_mod.process_mesh("cpu", (1, 1), ("dp", "tp")) is first
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert device_mod.process_mesh("cpu", (1, 1), ("dp", "tp")) is not first
