"""ResourcePool: a named set of devices, reserved as one Ray placement group with one bundle per device.

Models given the same pool are colocated (they share its devices); different pools are disjoint, so
their worker groups run concurrently (docs/design.md §3). Without GPUs each "device" is a CPU bundle, which
is how the whole system runs and is tested on a laptop.

Ranks are ordered by node (all bundles of the first node, then the next, ...) so that a worker
group's rank order, and hence its mesh, is stable and node-local ranks are consecutive.

CPU threads: on CPU a rank takes its share of its node's cores among the ranks that can run at the
same time on that node (controller/process.py cpu_threads). A pool alone counts its own ranks;
`share_cpus(pools)` makes pools that run at once (split placement, the rollout pool of
trainer.rollout_ahead=1) count each other's, so two busy pools do not both take every core.
"""

from __future__ import annotations

import functools
import os
import sys

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group


def ensure_ray(*, compute_on_cpu: bool = False, **init_kwargs) -> None:
    """Start (or join, when RAY_ADDRESS is set) a Ray cluster if this process has none yet. A cluster
    started here runs its processes in `embedded_worker_env(compute_on_cpu)`; a joined one keeps its
    nodes' own."""
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        init_kwargs.setdefault("include_dashboard", False)
        address = init_kwargs.get("address")
        if address != "local" and (address or os.environ.get("RAY_ADDRESS")):
            ray.init(**init_kwargs)
            return
        # Ray's processes (raylet, then every worker it starts) inherit the environment ray.init
        # starts them in; this process gets its own back. (A job runtime_env would do the same but
        # made each worker start ~2.5x slower: no pre-started workers, a runtime-env agent round trip.)
        env = embedded_worker_env(compute_on_cpu)
        previous = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            _start_local(init_kwargs)
        finally:
            for key, value in previous.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _start_local(init_kwargs: dict, attempts: int = 3) -> None:
    """ray.init of a new local cluster, started again when its node does not register in time. Ray
    waits a fixed 30 s for the raylet (not configurable); on a busy machine (a loaded laptop, CI running
    two test workers) the raylet can miss that once and come up fine on the next try."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**init_kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception for this one
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            ray.shutdown()
            note = f"the local Ray node did not start within Ray's 30 s; starting it again ({attempt}/{attempts - 1})"
            print(f"hybridflow: {note}", file=sys.stderr, flush=True)


# libgomp's spin before an idle intra-op thread sleeps, in turns of its wait loop: long enough to bridge
# the Python between two ops, short enough to give the core back soon to whatever else needs it.
WORKER_SPIN_COUNT = "3000"
# jemalloc's settings for workers that compute on CPU: freed pages are never returned to the kernel, so
# the next step's tensors reuse them (jemalloc otherwise purges them over 10 s, about one CPU step); and
# address space it no longer uses is unmapped, not retained: with it retained, a 0.5B model's worker grew
# by ~0.125 GB every step without bound as response lengths varied (docs/bench/vs_trl.md)
CPU_MALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1,retain:false"
# what, in the driver's environment, is the user's own allocator choice (then it reaches the workers as is)
_ALLOCATOR_KEYS = ("LD_PRELOAD", "MALLOC_CONF", "RAY_LD_PRELOAD_ON_WORKERS")


def embedded_worker_env(compute_on_cpu: bool = False) -> dict[str, str]:
    """Environment of the worker processes of an embedded cluster, set before they start, i.e. before
    torch loads its OpenMP runtime (libgomp on CPU) and the dynamic linker its allocator, which read these
    variables only then.

    GOMP_SPINCOUNT=3000: an intra-op thread waiting for work spins ~3000 turns, then sleeps. libgomp's
    default spins ~300k turns: whenever anything else wants a core (another pool, the driver, reward
    workers, other jobs) the spinning holds the core the team waits for, and on a loaded 2-core machine
    the 25M model's update took several times the wall time. PASSIVE (sleep at once) pays a kernel
    wake-up at every parallel op instead: on an idle machine the update and decode ran 1.14-1.75x slower
    than with a spin. The short spin keeps most of the idle gain and costs 1.05-1.3x PASSIVE's time beside
    a busy process (docs/bench/omp_wait.md; docs/design.md §3). The driver's own OMP_WAIT_POLICY or
    GOMP_SPINCOUNT, when set, wins.

    Where the workers compute on CPU, the jemalloc that Ray ships (and already preloads into its own
    daemons) is preloaded into them too, with CPU_MALLOC_CONF. glibc maps each block over 32 MB afresh and
    unmaps it when freed, and returns freed heap memory, so every step's large tensors (logits, the
    embedding's gradient, activations) page-fault their memory in again, zeroed by the kernel: at
    Qwen2.5-0.5B's shape 12 of the update's 17.5 s were kernel time (docs/bench/vs_trl.md). On GPUs those
    tensors live on the device, so GPU workers keep the default. A driver's own LD_PRELOAD, MALLOC_CONF or
    RAY_LD_PRELOAD_ON_WORKERS wins, and a Ray build without jemalloc changes nothing."""
    env = {}
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        env["GOMP_SPINCOUNT"] = WORKER_SPIN_COUNT  # else the user's choice reaches them by inheritance
    if compute_on_cpu and ray_jemalloc() and not any(k in os.environ for k in _ALLOCATOR_KEYS):
        env.update(RAY_LD_PRELOAD_ON_WORKERS="1", MALLOC_CONF=CPU_MALLOC_CONF)
    return env


def uses_cuda(device: str) -> bool:
    """Whether a run's workers compute on CUDA devices for resources.device=`device`: cuda, or auto on a
    machine torch finds one on."""
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


# run in a child process by gpu_info: prints "name<TAB>total bytes" of device 0, nothing without a GPU
_GPU_QUERY = (
    "import torch\n"
    "if torch.cuda.is_available():\n"
    "    p = torch.cuda.get_device_properties(0)\n"
    "    print(p.name, p.total_memory, sep='\\t')\n"
)


@functools.cache
def gpu_info() -> tuple[str, float] | None:
    """(CUDA device name, memory in GiB) of this machine's first GPU, None without one.

    Asked of a short-lived child process: the driver must not initialise CUDA, whose context would
    hold device memory on a GPU its workers need for the whole run. The child sees this machine's GPUs
    as the driver would (its CUDA_VISIBLE_DEVICES)."""
    import subprocess

    try:
        out = subprocess.run(
            [sys.executable, "-c", _GPU_QUERY], capture_output=True, text=True, timeout=300, check=True
        ).stdout.strip()
    except (subprocess.SubprocessError, OSError):
        return None
    if not out:
        return None
    name, total = out.rsplit("\t", 1)
    return name, int(total) / 2**30


def ray_jemalloc() -> str | None:
    """The jemalloc library Ray preloads into its processes (None where its build has none, e.g. macOS)."""
    from ray._private import services

    return services.JEMALLOC_SO


class ResourcePool:
    """A set of `n_devices` devices reserved on the cluster.

    n_devices:  how many devices (GPUs, or CPU slots when use_gpu is False).
    name:       shown in errors and in the demo's "what ran where" output.
    use_gpu:    None = GPUs if the cluster has any; True/False to force.
    cpus_per_device: CPUs reserved with each device (each worker process gets them).
    strategy:   Ray placement strategy: "PACK" (fill nodes in turn, spill over) or "SPREAD"/"STRICT_*".
    max_processes_per_device: how many separate worker processes (of different groups not built with
                create_colocated_groups) may share one device; each takes 1/this of the bundle.
    timeout_s:  how long to wait for the reservation before failing with what is free.
    """

    def __init__(
        self,
        n_devices: int,
        name: str = "pool",
        use_gpu: bool | None = None,
        cpus_per_device: float = 1.0,
        strategy: str = "PACK",
        max_processes_per_device: int = 4,
        timeout_s: float = 60.0,
    ):
        if n_devices < 1:
            raise ValueError(f"ResourcePool {name!r}: n_devices must be >= 1, got {n_devices}")
        ensure_ray()
        total = ray.cluster_resources()
        self.name = name
        self.n_devices = n_devices
        self.use_gpu = bool(total.get("GPU", 0) >= 1) if use_gpu is None else use_gpu
        self.cpus_per_device = cpus_per_device
        self.max_processes_per_device = max_processes_per_device
        _check_fits(name, n_devices, self.use_gpu, cpus_per_device, total)

        bundle = {"CPU": cpus_per_device, **({"GPU": 1} if self.use_gpu else {})}
        self.placement_group = placement_group([dict(bundle) for _ in range(n_devices)], strategy=strategy)
        if not self.placement_group.wait(timeout_s):
            free = ray.available_resources()
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"ResourcePool {name!r}: could not reserve {n_devices} x {bundle} within {timeout_s:.0f}s; "
                f"free now: CPU={free.get('CPU', 0):g} GPU={free.get('GPU', 0):g} "
                f"(other pools hold the rest? call .shutdown() on pools you no longer need)"
            )
        self.bundle_of_rank, self.node_of_rank = _order_by_node(self.placement_group)
        self.cpu_ranks_per_node = _count(self.node_of_rank)  # share_cpus adds other pools' ranks

    @property
    def world_size(self) -> int:
        return self.n_devices

    @property
    def nodes(self) -> list[str]:
        """Distinct node ids in rank order."""
        return list(dict.fromkeys(self.node_of_rank))

    def cpu_ranks(self, rank: int) -> int:
        """How many ranks (of this pool and the pools sharing its CPUs) may compute at once on the
        node of `rank`: that rank's CPU threads are the node's cores // this (cpu_threads)."""
        return self.cpu_ranks_per_node[self.node_of_rank[rank]]

    def actor_resources(self) -> dict:
        """Resources one worker process takes from its bundle (a fraction, so groups can share)."""
        share = 1.0 / self.max_processes_per_device
        return {"num_cpus": self.cpus_per_device * share, "num_gpus": share if self.use_gpu else 0}

    def shutdown(self) -> None:
        """Release the reservation (kill the pool's worker groups first)."""
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU"
        return f"ResourcePool({self.name!r}, {self.n_devices} x {kind}, nodes={len(self.nodes)})"


def share_cpus(pools: list[ResourcePool]) -> None:
    """Pools whose worker groups run at the same time share each node's cores: every rank counts the
    ranks of all `pools` on its node (colocated roles of one pool share a process, so they count once).
    Call before creating the pools' worker groups; threads are set when a process starts."""
    total: dict[str, int] = {}
    for pool in pools:
        for node, n in _count(pool.node_of_rank).items():
            total[node] = total.get(node, 0) + n
    for pool in pools:
        pool.cpu_ranks_per_node = {node: total[node] for node in pool.cpu_ranks_per_node}


def _count(nodes: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in nodes:
        out[node] = out.get(node, 0) + 1
    return out


def _check_fits(name: str, n: int, use_gpu: bool, cpus: float, total: dict) -> None:
    have_cpu, have_gpu = total.get("CPU", 0), total.get("GPU", 0)
    nodes = len([node for node in ray.nodes() if node.get("Alive")])
    asked = f"{n} GPU device(s) + {n * cpus:g} CPU" if use_gpu else f"{n} CPU device(s) of {cpus:g} CPU each"
    if (use_gpu and have_gpu < n) or have_cpu < n * cpus:
        hint = "" if use_gpu or have_gpu else " (no GPUs found: the pool uses CPU bundles)"
        raise ValueError(
            f"ResourcePool {name!r} asks for {asked}, but the cluster has {have_gpu:g} GPU and "
            f"{have_cpu:g} CPU in total on {nodes} node(s){hint}. Ask for fewer devices or add nodes."
        )


def _order_by_node(pg) -> tuple[list[int], list[str]]:
    """Bundle indices grouped by node (nodes in order of their first bundle), with each rank's node."""
    bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
    first: dict[str, int] = {}
    for b in sorted(bundle_nodes):
        first.setdefault(bundle_nodes[b], b)
    order = sorted(bundle_nodes, key=lambda b: (first[bundle_nodes[b]], b))
    return order, [bundle_nodes[b] for b in order]
