"""The limits and the process containment of reward code, applied in the reward worker process
(hybridflow/rewards/_worker.py) and the sample processes it forks. docs/operations.md says what is and
is not isolated.

Why rlimits in each forked sample process rather than the worker: the worker must keep answering the
trainer (and forking) whatever a sample does, so only sample processes are limited; RLIMIT_AS counts
from what the worker had mapped at the fork (the imported module and libraries are not the sample's).
Why a namespace or a subreaper: a `setsid` double fork leaves the process group that the timeout kills,
and its orphan would reparent to init. In a PID namespace (the worker's children are its members) the
kernel kills every member when the namespace's init, a child of the worker, dies with the worker. Where
a namespace is not allowed, the worker is a child subreaper: orphans reparent to it and `sweep` kills
them. Why a pids cgroup: RLIMIT_NPROC counts all of the user's processes and does not bind root.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.sandbox import SandboxConfig

PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWPID = 0x20000000
CGROUP_PREFIX = "hybridflow-reward-"


def cgroup_dir(worker_pid: int) -> str | None:
    """The pids cgroup of a worker, or None where no pids controller is mounted."""
    if os.path.isdir("/sys/fs/cgroup/pids"):  # cgroup v1
        return f"/sys/fs/cgroup/pids/{CGROUP_PREFIX}{worker_pid}"
    try:
        with open("/sys/fs/cgroup/cgroup.subtree_control") as f:  # cgroup v2
            return f"/sys/fs/cgroup/{CGROUP_PREFIX}{worker_pid}" if "pids" in f.read().split() else None
    except OSError:
        return None


def remove_cgroup(worker_pid: int) -> None:
    path = cgroup_dir(worker_pid)
    if path and os.path.isdir(path):
        try:
            os.rmdir(path)
        except OSError:  # still has members (it is emptied by killing them first) or not ours
            pass


def _remove_stale_cgroups(root: str) -> None:
    """Empty cgroups of workers that are gone (a worker killed with its trainer cannot remove its own)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith(CGROUP_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name.removeprefix(CGROUP_PREFIX)
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(root, name))
            except OSError:  # still has members
                pass


def _prctl(option: int, value: int) -> bool:
    return sys.platform.startswith("linux") and ctypes.CDLL(None, use_errno=True).prctl(option, value) == 0


def _unshare_pid() -> bool:
    return sys.platform.startswith("linux") and ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWPID) == 0


def _children_of(parents: set[int]) -> list[int]:
    """Processes whose parent is in `parents` (from /proc; the comm field may hold spaces and ')')."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid in parents:
                found.append(int(name))
    return found


def _run_init() -> None:
    """PID 1 of the namespace: reaps orphans until the worker dies (then the kernel kills all members)."""
    # Nothing inherited stays open here (the worker's pipe to the trainer above all): a worker that dies
    # before this process armed its death signal (a race under load) must still be seen at once by the
    # trainer's EOF, not after reward.startup_timeout_s; what is left of this process goes with the
    # worker's process group (pool.py kills it).
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != 0:  # the worker (outside the namespace, so seen as 0) is already gone
        os._exit(1)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            time.sleep(0.2)


class Sandbox:
    """Set up in the worker with `enter`; `in_child` runs in every forked sample process,
    `before_sample` before each sample; `sweep` kills orphans; `close` kills what is left."""

    def __init__(self, cfg: SandboxConfig, workdir: str):
        self.cfg, self.workdir = cfg, workdir
        self.mode = ""  # "pid_namespace" | "subreaper"
        self.init_pid: int | None = None
        self.cgroup: str | None = None

    def enter(self) -> None:
        """Before the user's module is imported, so that what its import starts is contained too."""
        if self.cfg.processes != "subreaper" and _unshare_pid():
            self.mode, self.init_pid = "pid_namespace", os.fork()
            if self.init_pid == 0:
                try:
                    _run_init()
                finally:
                    os._exit(1)
        elif self.cfg.processes == "pid_namespace":
            raise OSError("reward.sandbox.processes=pid_namespace: a PID namespace is not allowed here "
                          "(needs root or CAP_SYS_ADMIN); use auto or subreaper")  # fmt: skip
        else:
            self.mode = "subreaper"
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.cgroup = self._make_cgroup()
        os.environ["TMPDIR"] = self.workdir

    def _make_cgroup(self) -> str | None:
        path = cgroup_dir(os.getpid())
        if path:
            _remove_stale_cgroups(os.path.dirname(path))
        try:
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(self.cfg.max_procs))
            return path
        except (OSError, TypeError):  # not root, read-only, or no pids controller: RLIMIT_NPROC instead
            return None

    def after_import(self) -> None:
        os.chdir(self.workdir)

    def in_child(self) -> None:
        """In a freshly forked sample process: join the pids cgroup, set the limits (hard, so the
        reward code cannot raise them again)."""
        if self.cgroup:
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
                f.write("0")
        elif os.geteuid() != 0 and os.path.isdir(
            "/proc"
        ):  # RLIMIT_NPROC counts the user's processes, binds no root
            n = self._user_processes() + self.cfg.max_procs
            resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
        mapped = _vm_size()
        if mapped is not None:
            limit = mapped + self.cfg.memory_mb * 2**20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        size = self.cfg.file_size_mb * 2**20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    @staticmethod
    def _user_processes() -> int:
        uid = os.getuid()
        return sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)

    def before_sample(self) -> None:
        """RLIMIT_CPU counts a process's whole life: the sample's budget starts from what was used."""
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime + self.cfg.cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))

    def sweep(self, known: set[int]) -> int:
        """Kill every orphan that reparented to the worker (or the namespace's init); -> how many."""
        if not os.path.isdir("/proc"):  # no process table to read (not Linux): the process group kills only
            return 0
        parents = {os.getpid()} | ({self.init_pid} if self.init_pid else set())
        killed = 0
        for _ in range(1000):  # an orphan may fork again before it dies: until none is left
            orphans = [p for p in _children_of(parents) if p not in known and p != self.init_pid]
            if not orphans:
                break
            for pid in orphans:
                _kill(pid)
                if self.mode == "subreaper":  # ours to reap; the namespace's init reaps its own
                    _reap(pid)
            killed += len(orphans)
        return killed

    def close(self, known: set[int]) -> None:
        self.sweep(known)
        if self.init_pid:  # the kernel kills every member of the namespace with it
            _kill(self.init_pid)
            _reap(self.init_pid)
        if self.cgroup:
            remove_cgroup(os.getpid())


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _vm_size() -> int | None:
    """Bytes of address space this process has mapped (VmSize), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))
    except (OSError, StopIteration):
        return None


def limit_message(error: BaseException, cfg: SandboxConfig) -> str | None:
    """One line for a sample that hit a limit (None for any other error)."""
    if isinstance(error, MemoryError):
        return f"MemoryError: the sample exceeded reward.sandbox.memory_mb={cfg.memory_mb} (RLIMIT_AS)"
    if isinstance(error, OSError) and error.errno == errno.EFBIG:
        return f"OSError: the sample wrote past reward.sandbox.file_size_mb={cfg.file_size_mb} (RLIMIT_FSIZE)"
    if isinstance(error, OSError) and error.errno == errno.EAGAIN:
        return f"{type(error).__name__}: the sample could not start a process: reward.sandbox.max_procs={cfg.max_procs} reached"
    return None


def death_message(code: int | None, cfg: SandboxConfig) -> str:
    if code == -signal.SIGXCPU:
        return f"the sample used more than reward.sandbox.cpu_s={cfg.cpu_s:g} CPU seconds (RLIMIT_CPU); its process was killed"
    return f"the sample's process died (exit code {code})"
