"""WorkerGroup: N processes of a Worker class on a ResourcePool, driven as one object by the driver.

    pool = ResourcePool(4, name="critic")
    critic = WorkerGroup(Critic, pool, tp=2)       # one Ray actor per device, one gloo/NCCL group
    values = critic.compute_values(batch)          # protocol splits `batch`, gathers the outputs
    fut = actor.generate(prompts)                  # blocking=False method: returns a Future
    values = critic.compute_values(fut)            # each critic rank fetches its own shard

Every `@register`ed method of the class becomes a method of the group. `create_colocated_groups`
builds several roles in the same processes (one per device): separate groups to the driver, one
process group and one device underneath — how colocated models time-share a device (docs/design.md §3).
"""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.batch import Batch
from hybridflow.controller import strict_device
from hybridflow.controller.future import Future, notify_observer, wait_all
from hybridflow.controller.layout import shard_indices
from hybridflow.controller.process import FutureShard, PutShard, WorkerProcess
from hybridflow.controller.protocols import (
    GroupView,
    Protocol,
    RegisterSpec,
    get_protocol,
    registered_methods,
)
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import Worker

_REMOTE_PROCESS = None


class _Processes:
    """The Ray actors of one set of worker processes (shared by colocated groups)."""

    def __init__(self, pool: ResourcePool, name: str, dist_timeout_s: float = 600.0):
        global _REMOTE_PROCESS
        if pool.placement_group is None:
            raise RuntimeError(f"ResourcePool {pool.name!r} was shut down")
        _REMOTE_PROCESS = _REMOTE_PROCESS or ray.remote(WorkerProcess)
        self.pool, self.name = pool, name
        n = pool.world_size
        local = [pool.node_of_rank[:r].count(node) for r, node in enumerate(pool.node_of_rank)]
        self.actors = [
            _REMOTE_PROCESS.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pool.placement_group, placement_group_bundle_index=bundle
                ),
                **pool.actor_resources(),
            ).remote(name, rank, n, local[rank], pool.use_gpu, pool.cpu_ranks(rank), strict_device.enabled())
            for rank, bundle in enumerate(pool.bundle_of_rank)
        ]
        try:
            (addr, port) = wait_all([self.actors[0].master_address.remote()], [0], name, "<start>")[0]
            refs = [a.init_distributed.remote(addr, port, dist_timeout_s) for a in self.actors]
            self.pids = wait_all(refs, list(range(n)), name, "<join process group>")
        except BaseException:
            self.kill()
            raise

    def add_role(self, role: str, cls: type, kwargs: dict) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"role {role!r}: {cls!r} is not a subclass of hybridflow.controller.Worker")
        refs = [a.add_role.remote(role, cls, kwargs) for a in self.actors]
        wait_all(refs, list(range(len(self.actors))), role, f"{cls.__name__}.__init__")

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []


class WorkerGroup:
    """One role (Worker class) running on every device of a pool.

    WorkerGroup(worker_cls, pool, group_name=None, **init_kwargs): spawns one process per device
    of `pool` and builds `worker_cls(**init_kwargs)` in each. Use create_colocated_groups to put
    several roles in the same processes.
    """

    def __init__(self, worker_cls: type, pool: ResourcePool, *, group_name: str | None = None, **init_kwargs):
        name = group_name or worker_cls.__name__
        procs = _Processes(pool, name)
        try:
            self._setup(procs, name, worker_cls)
            procs.add_role(name, worker_cls, init_kwargs)
        except BaseException:
            procs.kill()
            raise

    @classmethod
    def _colocated(cls, procs: _Processes, role: str, worker_cls: type) -> WorkerGroup:
        group = cls.__new__(cls)
        group._setup(procs, role, worker_cls)
        return group

    def _setup(self, procs: _Processes, role: str, worker_cls: type) -> None:
        self._procs, self.name, self.worker_cls = procs, role, worker_cls
        self._layout_cache: dict[str, list] = {}
        for method, spec in registered_methods(worker_cls).items():
            get_protocol(spec.protocol)  # fail now on unknown protocol names
            if hasattr(WorkerGroup, method):
                raise ValueError(
                    f"{worker_cls.__name__}.{method}: the name clashes with WorkerGroup.{method}; rename it"
                )
            setattr(self, method, _GroupMethod(self, method, spec))

    # ---- facts -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._procs.actors)

    @property
    def pool(self) -> ResourcePool:
        return self._procs.pool

    @property
    def pids(self) -> list[int]:
        """Process id of each rank (colocated groups report the same pids)."""
        return list(self._procs.pids)

    @property
    def nodes(self) -> list[str]:
        return list(self._procs.pool.node_of_rank)

    def __repr__(self) -> str:
        return f"WorkerGroup({self.name!r}, {self.worker_cls.__name__} x {self.world_size} on {self.pool.name!r})"

    # ---- calls -----------------------------------------------------------------------------
    def execute_all(self, method: str, *args, **kwargs) -> list:
        """Call any method on every rank with the same arguments; list of per-rank results."""
        return self._call(method, RegisterSpec(Protocol.ONE_TO_ALL.value, True, None), args, kwargs)

    def execute_rank_zero(self, method: str, *args, **kwargs):
        return self._call(method, RegisterSpec(Protocol.RANK_ZERO.value, True, None), args, kwargs)

    def layouts(self, name: str | None) -> list:
        """Every rank's layout `name` (read once, then cached: layouts are fixed once used)."""
        if name not in self._layout_cache:
            refs = [a.get_layouts.remote(self.name, name) for a in self._procs.actors]
            self._layout_cache[name] = wait_all(
                refs, list(range(self.world_size)), self.name, f"layout {name!r}"
            )
        return self._layout_cache[name]

    def _call(self, method: str, spec: RegisterSpec, args: tuple, kwargs: dict, blocking: bool | None = None):
        proto = get_protocol(spec.protocol)
        layout = spec.layout or proto.default_layout
        view = GroupView(self.name, self.world_size, self.layouts(layout) if layout else None)
        if proto.sharded:
            plan = proto.plan(view)
            shards = _shard_arguments(args, kwargs, plan.n_shards, f"{self.name}.{method}")
            # a rank whose shard is None takes no part (WHOLE_BATCH: only rank 0 runs)
            calls = [(r, shards[s]) for r, s in enumerate(plan.shard_of_rank) if s is not None]
            collect_ranks = plan.collect_ranks
        else:
            args, kwargs = (
                _resolve_futures(args),
                {k: v for k, v in zip(kwargs, _resolve_futures(kwargs.values()))},
            )
            per_rank = proto.distribute(view, args, kwargs)
            calls = [(r, _put_batches(*call)) for r, call in enumerate(per_rank) if call is not None]
            collect_ranks = None
        refs = [
            self._procs.actors[r].execute.options(num_returns=2).remote(self.name, method, a, k)
            for r, (a, k) in calls
        ]
        future = Future(
            self.name,
            method,
            [r for r, _ in calls],
            [s for s, _ in refs],
            [o for _, o in refs],
            proto,
            view,
            collect_ranks,
        )
        notify_observer(future)
        blocking = spec.blocking if blocking is None else blocking
        return future.get() if blocking else future

    def shutdown(self) -> None:
        """Kill this group's processes (and so every group colocated with it)."""
        self._procs.kill()


class _GroupMethod:
    """A registered worker method bound to a group: group.compute_values(batch)."""

    def __init__(self, group: WorkerGroup, method: str, spec: RegisterSpec):
        self._group, self._method, self.spec = group, method, spec
        self.__doc__ = getattr(getattr(group.worker_cls, method), "__doc__", None)

    def __call__(self, *args, **kwargs):
        return self._group._call(self._method, self.spec, args, kwargs)

    def future(self, *args, **kwargs) -> Future:
        """This call without blocking, whatever @register said: returns a Future."""
        return self._group._call(self._method, self.spec, args, kwargs, blocking=False)

    def __repr__(self) -> str:
        return f"<group method {self._group.name}.{self._method} [{self.spec.protocol}]>"


def create_colocated_groups(
    pool: ResourcePool,
    roles: dict[str, tuple[type, dict]],
    group_name: str | None = None,
    dist_timeout_s: float = 600.0,
) -> dict[str, WorkerGroup]:
    """Several roles in one process per device of `pool`: {"actor": (Actor, {...}), "ref": (Ref, {})}.

    Returns one WorkerGroup per role; they share processes, device and process group, and each
    role instance keeps its own layouts. Roles are constructed in the order given. dist_timeout_s:
    the process group's collective timeout (tests shorten it so a deadlock fails fast).
    """
    procs = _Processes(pool, group_name or "+".join(roles), dist_timeout_s)
    try:
        groups = {}
        for role, (cls, kwargs) in roles.items():
            groups[role] = WorkerGroup._colocated(procs, role, cls)
            procs.add_role(role, cls, dict(kwargs or {}))
        return groups
    except BaseException:
        procs.kill()
        raise


# ---- argument distribution -------------------------------------------------------------------
def _resolve_futures(values) -> list:
    """Generic protocols: a sharded future becomes a whole-output placeholder the workers fetch
    themselves; any other future is resolved here (its result is small: lists, dicts)."""
    out = []
    for v in values:
        if isinstance(v, Future) and v.sharded:
            sizes, outs = v.collected_refs()
            out.append(FutureShard(sizes, outs, 0, 0, v.row_range))
        else:
            out.append(v.get() if isinstance(v, Future) else v)
    return out


def _put_batches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Put Batch arguments in the object store once, however many ranks receive them."""
    memo: dict[int, PutShard] = {}

    def put(v):
        if isinstance(v, Batch):
            if id(v) not in memo:
                memo[id(v)] = PutShard([ray.put(v)], 0)
            return memo[id(v)]
        return v

    return tuple(put(a) for a in args), {k: put(v) for k, v in kwargs.items()}


def _shard_arguments(args: tuple, kwargs: dict, n: int, where: str) -> list[tuple[tuple, dict]]:
    """Per shard (args, kwargs): Batches padded+split and put once per shard, sharded futures
    turned into FutureShard placeholders, everything else broadcast."""
    values = [v.get() if isinstance(v, Future) and not v.sharded else v for v in (*args, *kwargs.values())]
    lengths = {len(v) for v in values if isinstance(v, Batch)}
    if len(lengths) > 1:
        raise ValueError(
            f"{where}: Batch arguments have different sizes {sorted(lengths)}; they are split together"
        )
    per_value = []
    for v in values:
        if isinstance(v, Batch):
            parts = []
            for s in range(n):
                rows, pad = shard_indices(len(v), n, s)
                parts.append(PutShard([ray.put(v.index(rows))], pad))
            per_value.append(parts)
        elif isinstance(v, Future):
            sizes, outs = v.collected_refs()
            per_value.append([FutureShard(sizes, outs, s, n, v.row_range) for s in range(n)])
        else:
            per_value.append([v] * n)
    n_args = len(args)
    out = []
    for s in range(n):
        vals = [pv[s] for pv in per_value]
        out.append((tuple(vals[:n_args]), dict(zip(kwargs, vals[n_args:]))))
    return out
