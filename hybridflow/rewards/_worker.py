"""A reward worker process: imports the user's reward code (never the trainer), then scores chunks of samples.

Started by `pool._Worker` as `python -m hybridflow.rewards._worker FD PARENT_PID` (not multiprocessing's
spawn/fork: those re-import the parent's __main__, which inside a Ray actor or an unguarded user
script would re-run it). It dies with its parent: PR_SET_PDEATHSIG on Linux (the kernel kills it even
while it hangs in a C loop holding the GIL), a watchdog thread elsewhere. The kernel ties the signal to
the parent *thread* that started the worker, so an executor belongs to a long-lived thread (the
trainer's main thread).

Protocol on the duplex connection FD:
  parent -> worker: (spec, fn_kwargs, batched, registered, sandbox, workdir) once; then per chunk ("seq", items, timeout_s) |
                    ("fork", items, timeout_s) | ("batch", items); None to stop.
  worker -> parent: ("ready", pid, (convention, required columns), containment) | ("init_error", one_line, traceback); then per sample
                    ("ok", i, score) | ("err", i, traceback) | ("timeout", i, message, started) |
                    ("died", i, message); ("spill", i) when sample i is slow enough that it may hang;
                    per batched chunk ("batch", [i...], [scores] | None, traceback | None).
User code runs in forked children (they inherit the imported module), never in this process, so it
always answers (`Scheduler`): "seq" scores a chunk's samples one after another in one child; "fork"
gives every sample a child of its own; a slow "seq" sample makes the rest of its chunk "fork" (see
pool.py). The worker kills a child whose sample passed timeout_s. Only a batched call runs here (the
parent times it and kills this worker).
An item is (index, data_source, solution_str, ground_truth, extra_info, prompt).
"""

from __future__ import annotations

import importlib
import math
import os
import signal
import sys
import threading
import time

# children of one "fork" chunk alive at once (more wait for a free slot)
MAX_FORKS = 64
SWEEP_S = 0.5  # how often orphans of reward code are looked for and killed (rewards/sandbox.py)


def die_with_parent(parent_pid: int) -> None:
    """Be killed when the parent goes away, however this process is stuck."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:  # no kernel help: a thread that polls (cannot fire while C code holds the GIL)

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() not in (parent_pid, 0):  # the parent died before the signal was armed (0: the
        # parent is outside this process's PID namespace, rewards/sandbox.py)
        os._exit(1)


def summary(error: BaseException) -> str:
    """One line saying what went wrong and where in the user's code, e.g.
    "importing it raised ZeroDivisionError: division by zero (reward.py:3)"."""
    import traceback

    from hybridflow.errors import UserError

    if isinstance(error, UserError):  # ours, already phrased for the user (no function 'scroe', ...)
        return " ".join(str(error).split())
    if isinstance(error, SystemExit):
        what = f"importing it called sys.exit({error.code!r})"
    else:
        what = "importing it raised " + " ".join(f"{type(error).__name__}: {error}".split())
    ours = os.path.dirname(os.path.abspath(__file__)), "<frozen"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(ours)]
    return f"{what} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else what


def serve(conn, parent_pid: int) -> None:
    import traceback

    from hybridflow.rewards.sandbox import Sandbox

    spec, fn_kwargs, batched, registered, preload, sandbox_cfg, workdir = conn.recv()
    sandbox = Sandbox(sandbox_cfg, workdir)
    try:
        sandbox.enter()
        for module in preload:
            importlib.import_module(module)
        fn, convention, required = load(spec, fn_kwargs, batched, registered)
        sandbox.after_import()
    except BaseException as e:  # SystemExit / KeyboardInterrupt at import too: reported, not a silent exit
        conn.send(("init_error", summary(e), traceback.format_exc()))
        sandbox.close(set())
        return
    conn.send(("ready", os.getpid(), (convention, required), sandbox.mode))
    scheduler = Scheduler(conn, fn, fn_kwargs, sandbox, convention)
    try:
        scheduler.serve()
    finally:
        scheduler.close()


def load(spec: str, fn_kwargs: dict, batched: bool | None, registered: bytes | None) -> tuple:
    """The reward function of `spec` and its calling convention (rewards/conventions.py); `registered`:
    the user-registered functions it may name, pickled by value in the trainer (cloudpickle)."""
    from hybridflow.rewards.conventions import calling_convention
    from hybridflow.rewards.registry import load_reward_fn, register_reward

    if registered is not None:
        import cloudpickle

        for name, user_fn in cloudpickle.loads(registered).items():
            register_reward(name)(user_fn)
    fn, declared = load_reward_fn(spec)
    convention, required = calling_convention(fn, declared if batched is None else batched, fn_kwargs)
    return fn, convention, required


def score_one(run_per_sample, fn, item, fn_kwargs, sandbox) -> tuple:
    import traceback

    from hybridflow.rewards.sandbox import limit_message

    try:
        sandbox.before_sample()
        return ("ok", item[0], run_per_sample(fn, item, fn_kwargs))
    except BaseException as e:  # sys.exit() inside the function is this sample's error, not the worker's end
        return ("err", item[0], limit_message(e, sandbox.cfg) or traceback.format_exc())


def _write_framed(fd: int, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(4, "little") + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts = []
    while n:
        part = os.read(fd, n)
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def _next_chunk(fd: int) -> list | None:
    import pickle

    head = _read_exact(fd, 4)
    data = None if head is None else _read_exact(fd, int.from_bytes(head, "little"))
    return None if data is None else pickle.loads(data)


class _Child:
    """A forked child scoring samples one after another, writing one framed pickle per result. A runner
    (items=None) takes chunk after chunk from its input pipe, so what the reward function caches or
    imports on its first call stays for the next chunks; otherwise the child scores `items` and exits."""

    def __init__(self, fn, fn_kwargs: dict, sandbox, items: list | None = None):
        import pickle

        from hybridflow.rewards.registry import run_per_sample

        me = os.getpid()
        r, w = os.pipe()
        cmd_r, cmd_w = os.pipe() if items is None else (None, None)
        pid = os.fork()
        if pid == 0:  # the child: score, write the results, leave without running any cleanup
            try:
                os.close(r)
                if cmd_w is not None:
                    os.close(cmd_w)
                os.setpgid(0, 0)  # its own group: a kill takes what it started too
                die_with_parent(me)
                sandbox.in_child()
                chunks = [items] if items is not None else iter(lambda: _next_chunk(cmd_r), None)
                for chunk in chunks:
                    for item in chunk:
                        _write_framed(
                            w, pickle.dumps(score_one(run_per_sample, fn, item, fn_kwargs, sandbox))
                        )
            finally:
                os._exit(0)
        os.close(w)
        if cmd_r is not None:
            os.close(cmd_r)
        try:
            os.setpgid(pid, pid)  # also from this side, so a kill right away finds the group
        except OSError:
            pass
        self.pid, self.fd, self.cmd, self.seq = pid, r, cmd_w, items is None
        self.items, self.pos, self.buf = list(items or []), 0, b""
        self.start = time.monotonic()  # of the sample at `pos`
        self.last = None  # set when the rest was handed to other children: pos of the last one to take

    @property
    def busy(self) -> bool:
        return self.pos < len(self.items)

    def assign(self, items: list) -> None:
        import pickle

        self.items, self.pos, self.start = items, 0, time.monotonic()
        _write_framed(self.cmd, pickle.dumps(items))

    def results(self, data: bytes) -> list[tuple]:
        import pickle

        self.buf += data
        out = []
        while len(self.buf) >= 4 and len(self.buf) >= 4 + int.from_bytes(self.buf[:4], "little"):
            n = int.from_bytes(self.buf[:4], "little")
            out.append(pickle.loads(self.buf[4 : 4 + n]))
            self.buf = self.buf[4 + n :]
        return out

    def close(self, kill: bool) -> int | None:
        """Kill it (or reap it, when it ended) and close its pipes; -> its exit code when reaped."""
        code = None
        if kill:
            _kill_group(self.pid)
        else:
            code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        for fd in (self.fd, self.cmd):
            if fd is not None:
                os.close(fd)
        return code


class Scheduler:
    """The worker's loop. User code runs only in forked children, so this process always answers:
    "seq" chunks go to one runner child that scores their samples one after another; when a sample
    runs longer than `spill_after()` (it may hang), the chunk's other samples are handed to children
    of their own, all at once, and the parent is told ("spill"), so it sends its queued samples as
    "fork" chunks too: every sample of a batch that hangs starts within about spill_after() of the
    first, so the batch costs about timeout_s. A child whose sample passes timeout_s is killed."""

    def __init__(self, conn, fn, fn_kwargs: dict, sandbox, convention: str):
        from collections import deque

        self.conn, self.fn, self.fn_kwargs, self.sandbox = conn, fn, fn_kwargs, sandbox
        self.convention = convention
        self.swept = 0.0  # when orphans were last looked for (rewards/sandbox.py)
        self.children: dict[int, _Child] = {}  # read fd -> child
        self.runner: _Child | None = None  # the child that takes "seq" chunks
        self.queue: deque = deque()  # samples waiting for a child of their own (at most MAX_FORKS run)
        self.timeout_s = 10.0
        self.recent: deque = deque(maxlen=64)  # seconds the last completed samples took

    def spill_after(self) -> float:
        """A sample this slow may hang: timeout_s / 10, or 3 x the slowest recent sample (a reward
        that is slow by nature keeps its samples apart, up to timeout_s / 2)."""
        return min(self.timeout_s / 2, max(self.timeout_s / 10, 3 * max(self.recent, default=0.0)))

    def serve(self) -> None:
        import select

        while True:
            fds = [self.conn.fileno(), *self.children]
            readable, _, _ = select.select(fds, [], [], min(self._next_event(), SWEEP_S))
            for fd in readable:
                if fd != self.conn.fileno():
                    self._read(self.children[fd])
                elif not self._accept():
                    return
            self._check_clocks()
            self._start_queued()
            if time.monotonic() - self.swept >= SWEEP_S:
                self.sandbox.sweep({c.pid for c in self.children.values()})
                self.swept = time.monotonic()

    def close(self) -> None:
        """Kill the sample processes, then everything they left behind."""
        for child in list(self.children.values()):
            self._drop(child, kill=True)
        self.sandbox.close(set())

    def _accept(self) -> bool:
        """One message of the parent; False when it says stop or is gone."""
        import traceback

        from hybridflow.rewards.registry import run_batched

        try:
            msg = self.conn.recv()
        except EOFError:
            return False
        if msg is None:
            return False
        mode, items = msg[0], msg[1]
        if mode == "batch":  # one call on the whole chunk, here (the parent's clock kills this worker)
            idx = [it[0] for it in items]
            try:
                self.conn.send(
                    ("batch", idx, run_batched(self.fn, items, self.fn_kwargs, self.convention), None)
                )
            except BaseException:
                self.conn.send(("batch", idx, None, traceback.format_exc()))
            return True
        self.timeout_s = msg[2]
        if mode == "seq" and items and not (self.runner and self.runner.busy):
            self._run_seq(items)
        else:
            self.queue.extend(items)
        return True

    def _run_seq(self, items: list) -> None:
        if self.runner is None:
            self.runner = _Child(self.fn, self.fn_kwargs, self.sandbox)
            self.children[self.runner.fd] = self.runner
        self.runner.assign(items)

    def _start_queued(self) -> None:
        while self.queue and len(self.children) < MAX_FORKS:
            child = _Child(self.fn, self.fn_kwargs, self.sandbox, [self.queue.popleft()])
            self.children[child.fd] = child

    def _read(self, child: _Child) -> None:
        data = os.read(child.fd, 1 << 16)
        from hybridflow.rewards.sandbox import death_message

        for result in child.results(data):
            now = time.monotonic()
            if child.last is None or child.pos <= child.last:
                self.conn.send(result)
                self.recent.append(now - child.start)
            child.pos, child.start = child.pos + 1, now
        if child.last is not None and child.pos > child.last:
            self._drop(child, kill=True)  # its other samples were handed out: stop it
        elif not data:  # the child ended
            code = self._drop(child, kill=False)
            if child.busy:  # no result: it died on that sample (os._exit, a signal)
                i = child.items[child.pos][0]
                self.conn.send(("died", i, death_message(code, self.sandbox.cfg)))
                rest = child.items[child.pos + 1 :] if child.last is None else []
                if rest:  # the chunk goes on in a new runner
                    self._run_seq(rest) if child.seq else self.queue.extend(rest)

    def _drop(self, child: _Child, kill: bool) -> int | None:
        del self.children[child.fd]
        if child is self.runner:
            self.runner = None
        return child.close(kill)

    def _next_event(self) -> float:
        deadlines = [self._deadline(c) for c in self.children.values() if c.busy]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else math.inf

    def _deadline(self, child: _Child) -> float:
        spills = child.seq and child.last is None
        return child.start + (self.spill_after() if spills else self.timeout_s)

    def _check_clocks(self) -> None:
        now = time.monotonic()
        for child in [c for c in self.children.values() if c.busy]:
            if now - child.start >= self.timeout_s:
                i = child.items[child.pos][0]
                self._drop(child, kill=True)
                message = f"no result within {self.timeout_s:g}s; its process was killed"
                self.conn.send(("timeout", i, message, child.start))
                if child.last is None:
                    self.queue.extend(child.items[child.pos + 1 :])
            elif child.seq and child.last is None and now - child.start >= self.spill_after():
                child.last = child.pos  # this one may hang: every later sample gets a child of its own
                self.queue.extend(child.items[child.pos + 1 :])
                self.conn.send(("spill", child.items[child.pos][0]))


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
    os.waitpid(pid, 0)


if __name__ == "__main__":
    parent = int(sys.argv[2])
    die_with_parent(parent)
    from multiprocessing.connection import Connection

    serve(Connection(int(sys.argv[1])), parent)
