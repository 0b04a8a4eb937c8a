"""Worker: the base class of every SPMD worker (actor, critic, reference, reward, rollout, ...).

A worker group runs one process per device; each process joins the group's `torch.distributed`
process group (gloo on CPU, NCCL on GPU) before any Worker is built, so `__init__` can already use
collectives. A Worker knows its rank, world size and device, and declares named mesh *layouts*
that the transfer protocols read:

    class Critic(Worker):
        def __init__(self, tp: int):
            mesh = self.build_device_mesh(tp=tp)   # (pp, dp, tp) mesh; also sets layout "train"
            ...

        @register(Protocol.THREE_D, layout="train")
        def compute_values(self, batch: Batch) -> Batch: ...

Several Worker classes may live in one process (colocated roles, see create_colocated_groups);
they share the process group and the device, while each keeps its own layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridflow.controller.device import process_mesh
from hybridflow.controller.layout import Layout, default_layout
from hybridflow.controller.protocols import Protocol, register


@dataclass(frozen=True)
class WorkerContext:
    """Facts about this worker process, set by its WorkerGroup before any Worker is constructed."""

    group_name: str
    rank: int
    world_size: int
    local_rank: int  # rank among this group's processes on the same node
    node_id: str
    device: str  # "cpu" or "cuda:N", the GPU Ray assigned (N = 0 where Ray restricts the process to it)
    backend: str  # "gloo" or "nccl"


_CONTEXT: WorkerContext | None = None


def set_worker_context(ctx: WorkerContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def local_worker_context(rank: int = 0, world_size: int = 1, device: str = "cpu") -> WorkerContext:
    """Make Workers constructible in this process without Ray (unit tests of one worker, world 1).

    No process group is created; a test that needs one calls torch.distributed.init_process_group.
    """
    ctx = WorkerContext("local", rank, world_size, rank, "local", device, "gloo")
    set_worker_context(ctx)
    return ctx


def get_worker_context() -> WorkerContext:
    if _CONTEXT is None:
        raise RuntimeError(
            "this Worker is not running inside a WorkerGroup; build it with WorkerGroup(cls, pool) "
            "or call hybridflow.controller.local_worker_context() first (single-process tests)"
        )
    return _CONTEXT


class Worker:
    """Base class of SPMD workers. Subclasses need not call super().__init__()."""

    # ---- where am I ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return get_worker_context().rank

    @property
    def world_size(self) -> int:
        return get_worker_context().world_size

    @property
    def local_rank(self) -> int:
        return get_worker_context().local_rank

    @property
    def device(self) -> torch.device:
        return torch.device(get_worker_context().device)

    @property
    def context(self) -> WorkerContext:
        return get_worker_context()

    # ---- resources -----------------------------------------------------------------------------
    @register(Protocol.ONE_TO_ALL)
    def memory_stats(self) -> dict:
        """This rank's peak host RSS and, on CUDA, peak device memory since the last call (which resets
        it), in GiB: the trainer logs them per role every step (trainers/perf.py)."""
        import resource

        gib = 1024**3
        out = {"host_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
        if self.device.type == "cuda":
            out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / gib
            out["max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / gib
            out["device_name"] = torch.cuda.get_device_name(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return out

    @register(Protocol.WHOLE_BATCH)
    def apply(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` on rank 0, Batch and future arguments whole: a small computation
        moved to where the data already is (the RL drivers' advantage phase, docs/design.md §3), so
        futures feed it and its output feeds other groups without passing through the driver. `fn`
        must be importable here (a module-level function); ranks other than 0 are not called."""
        return fn(*args, **kwargs)

    # ---- layouts -------------------------------------------------------------------------------
    def _layouts(self) -> dict[str, Layout]:
        return self.__dict__.setdefault("_hf_layouts", {})

    def set_layout(
        self,
        name: str,
        *,
        dp_rank: int,
        dp_size: int,
        collect: bool | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        **extra,
    ) -> Layout:
        """Declare this rank's place in the named mesh (see layout.Layout for the fields).

        Set layouts in __init__ or in a method the driver calls before the first call that uses
        them; the controller reads a layout once and then relies on it, so changing a layout that
        was already read is an error.
        """
        lay = Layout.create(dp_rank, dp_size, collect, tp_rank, tp_size, pp_rank, pp_size, **extra)
        old = self._layouts().get(name)
        published = self.__dict__.setdefault("_hf_published", set())
        if old is not None and old != lay and name in published:
            raise RuntimeError(
                f"layout {name!r} of rank {self.rank} was already used by the controller ({old}); "
                "layouts are fixed once used — declare a new layout name instead"
            )
        self._layouts()[name] = lay
        return lay

    def get_layout(self, name: str | None) -> Layout:
        """The named layout; `None` means plain data parallelism over the whole group."""
        if name is None:
            return default_layout(self.rank, self.world_size)
        if name not in self._layouts():
            raise KeyError(
                f"{type(self).__name__} rank {self.rank} has no layout {name!r} (has {sorted(self._layouts())}); "
                f"call self.set_layout({name!r}, dp_rank=..., dp_size=...) before methods that use it"
            )
        self.__dict__.setdefault("_hf_published", set()).add(name)
        return self._layouts()[name]

    # ---- meshes --------------------------------------------------------------------------------
    def build_device_mesh(
        self, *, pp: int = 1, tp: int = 1, dp: int | None = None, layout: str | None = "train"
    ):
        """A torch DeviceMesh of shape (pp, dp, tp) over this group, tp fastest-varying.

        Consecutive ranks form a tp group (they share a node when possible); dp defaults to
        world_size / (pp * tp). When `layout` is given, also declares it from this rank's mesh
        coordinates (collected: tp rank 0 on the last pp stage). The process's roles share one mesh
        (its process groups) per shape (device.process_mesh).
        """
        dp = dp if dp is not None else self.world_size // (pp * tp)
        if pp * dp * tp != self.world_size:
            raise ValueError(f"mesh pp={pp} x dp={dp} x tp={tp} != world size {self.world_size}")
        device_type = "cuda" if self.device.type == "cuda" else "cpu"
        mesh = process_mesh(device_type, (pp, dp, tp), ("pp", "dp", "tp"))
        if layout is not None:
            r = self.rank
            self.set_layout(
                layout,
                dp_rank=(r // tp) % dp,
                dp_size=dp,
                tp_rank=r % tp,
                tp_size=tp,
                pp_rank=r // (tp * dp),
                pp_size=pp,
            )
        return mesh
