"""Runs one piece of model-written Python, contained: `python -I _code_runner.py CPU_S MEMORY_MB FILE_MB
MAX_PROCS PROCESSES` in the code's own temporary directory (main.py there), started by agent/code_tool.py with a
scrubbed environment. Imports only the standard library, so it starts in tens of milliseconds.

runner (this process) -> init (PID 1 of new PID, network and mount namespaces, where the OS allows)
-> the code's process (rlimits; no capabilities left after its exec; python main.py). When the code's
process ends, init exits and the kernel kills every process left in its PID namespace; init dies with
the runner (PR_SET_PDEATHSIG), which the tool kills on a timeout. Inside the namespaces: no network
interface but a down loopback, a /proc showing only the namespace's processes, every mount read-only
but the code's directory. Where namespaces are not allowed, the runner is a subreaper that kills
whatever the code left behind, and the network and file system are the user's (docs/rollout.md).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 32, 4096, 16384, 1 << 18
# a mount's own flags, kept on the read-only remount (a user namespace may not drop them)
KEPT_FLAGS = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
_libc = ctypes.CDLL(None, use_errno=True)


def isolate(processes: str) -> str:
    """Enter new PID, network and mount namespaces (a user namespace first when not root) -> the mode.
    processes: sandbox.processes; subreaper skips the namespaces, pid_namespace requires them."""
    flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS
    if processes != "subreaper" and os.geteuid() == 0 and _libc.unshare(flags) == 0:
        return "namespaces"
    uid, gid = os.geteuid(), os.getegid()
    if processes != "subreaper" and _libc.unshare(flags | CLONE_NEWUSER) == 0:
        for name, text in (
            ("uid_map", f"{uid} {uid} 1"),
            ("setgroups", "deny"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        return "user_namespaces"
    if processes == "pid_namespace":
        raise OSError(
            "sandbox.processes=pid_namespace: namespaces are not allowed here; use auto or subreaper"
        )
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    return "subreaper"


def _mount(source, target, fstype, flags) -> int:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    return _libc.mount(enc(source), enc(target), enc(fstype), flags, None)


def seal_filesystem(workdir: str) -> None:
    """In the new mount namespace: a /proc of its own, every mount read-only but `workdir`."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID)
    _mount(workdir, workdir, None, MS_BIND)  # its own mount, left writable below
    os.chdir(workdir)  # onto the new mount: the old working directory is the read-only one beneath
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4], line.split()[5].split(",")) for line in f]
    for point, options in mounts:
        if point != workdir and not point.startswith("/proc"):
            kept = sum(KEPT_FLAGS.get(o, 0) for o in options)
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def limit(cpu_s: float, memory_mb: int, file_mb: int, max_procs: int) -> None:
    """In the code's process: hard limits it cannot raise again, and an empty capability bounding set, so
    that root (whose processes RLIMIT_NPROC does not bind: the pids cgroup does) gets no capability back
    at exec: no remounting the file system writable, no reading other users' files past their modes."""
    for cap in range(64):
        _libc.prctl(PR_CAPBSET_DROP, cap)  # fails past the last capability this kernel has: harmless
    _libc.prctl(PR_SET_NO_NEW_PRIVS, 1)
    for kind, value in ((resource.RLIMIT_CPU, int(cpu_s + 0.999)), (resource.RLIMIT_AS, memory_mb * 2**20),
                        (resource.RLIMIT_FSIZE, file_mb * 2**20), (resource.RLIMIT_CORE, 0)):  # fmt: skip
        resource.setrlimit(kind, (value, value))
    uid = os.getuid()  # RLIMIT_NPROC counts the user's processes: what it has now plus the budget
    mine = sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (mine + max_procs, mine + max_procs))


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _wait(pid: int) -> int:
    """Wait for `pid`, reaping any other child (orphans reparented here) meanwhile."""
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            return _exit_code(status)


def run_code(cpu_s: float, memory_mb: int, file_mb: int, max_procs: int) -> int:
    code = os.fork()
    if code == 0:
        try:
            limit(cpu_s, memory_mb, file_mb, max_procs)
            os.execve(sys.executable, [sys.executable, "-I", "main.py"], dict(os.environ))
        except BaseException as e:  # noqa: BLE001  (the code never ran: say why on its output)
            print(f"sandbox: could not start the code: {e}", flush=True)
        os._exit(127)
    return _wait(code)


def join_pids_cgroup(max_procs: int) -> None:
    """Root: a pids cgroup of its own (the reward sandbox's, rewards/sandbox.py), so a fork bomb stops at
    max_procs; removed by the tool once the runner is gone."""
    from hybridflow.rewards.sandbox import cgroup_dir

    path = cgroup_dir(os.getpid())
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_procs + 2))  # + init and the code's own process
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write("0")
    except (OSError, TypeError):  # not writable, or no pids controller: the namespace's end kills them
        pass


def main() -> int:
    cpu_s, memory_mb, file_mb, max_procs = float(sys.argv[1]), *map(int, sys.argv[2:5])
    if os.geteuid() == 0:
        join_pids_cgroup(max_procs)
    try:
        mode = isolate(sys.argv[5])
    except OSError as e:
        print(f"\nerror: {e}", file=sys.stderr, flush=True)
        return 126
    print(f"{mode}", file=sys.stderr, flush=True)  # the tool reads the mode from the first stderr line
    if mode == "subreaper":
        status = run_code(cpu_s, memory_mb, file_mb, max_procs)
        _sweep()
        return status
    init = os.fork()  # the namespace's PID 1
    if init == 0:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        seal_filesystem(os.getcwd())
        os._exit(run_code(cpu_s, memory_mb, file_mb, max_procs))  # the kernel then kills what is left
    return _exit_code(os.waitpid(init, 0)[1])


def _sweep() -> None:
    """Subreaper mode: kill every process the code left behind (they reparented here) until none is."""
    for _ in range(1000):
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(p) == os.getpid()]
        if not kids and pid == 0:
            return
        for k in kids:
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
