"""The reward worker processes and the scheduler that feeds them chunks and enforces the timeouts.

Why persistent workers fed chunks: cheap rewards (string match, ~10 us) must not pay process start-up
or one round trip per sample, so each worker receives a chunk and streams one small message per sample
back; the worker times each sample (its clock restarts at each result), and the parent keeps only a
backstop for a worker that falls silent (BACKSTOP_S past timeout_s). A batched function's call is one
sample to the clock: the parent kills its worker timeout_s after sending the chunk.

Why a second mode: a sample that hangs costs timeout_s, and one worker's chunk holds many samples.
The worker runs user code only in forked children (hybridflow/rewards/_worker.py): one persistent
runner per worker for the chunks, so it stays responsive and what a reward function caches on its
first call is kept. When a sample runs past timeout_s / 10 (or 3 x the slowest recent sample, for rewards slow
by nature) the rest of its chunk goes to one child per sample, all at once, and the worker says
"spill"; the pool then re-cuts the batch's queued samples into one "fork" chunk per worker, sent at
once even to busy workers. Every sample of a batch that hangs starts within about timeout_s / 10 of the
first, so the batch costs about 1 x timeout_s (`reward/timeout_waits` counts the timeout_s periods
waited one after another; up to _worker.MAX_FORKS children per worker run at once, more wait for a
slot). Those samples share the CPUs, so a CPU-heavy reward can time out there where it would not
alone; such a sample is counted and reported like any timeout.

A worker is started with the reward spec and imports the user's module itself: the trainer process
never imports user reward code, and an import that raises, exits or hangs is a one-line
RewardSpecError.

A worker that dies (idle or busy) or falls silent is replaced; its samples in flight are queued again,
once. Its output goes through a pipe: the first SHOWN_BYTES to stderr, the last TAIL_BYTES kept in
output_dir/reward_output/ (`_Output`).
"""

from __future__ import annotations

import fcntl
import glob
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from hybridflow.errors import RewardSpecError
from hybridflow.rewards.registry import Item
from hybridflow.rewards.sandbox import remove_cgroup

BACKSTOP_S = 10.0  # beyond the worker's own timing: how long a worker may stay silent before it is killed
WORKDIR_PREFIX = "hybridflow-reward-"
SHOWN_BYTES = 64 * 1024  # of a worker's output (reward code's prints included) passed on to stderr
TAIL_BYTES = 64 * 1024  # of its last output, kept in output_dir/reward_output/ when it ends

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import RewardConfig


@dataclass
class RewardError:
    index: int  # position in the batch
    sample_id: str  # the index and, when known, the sample's uid
    kind: str  # "exception" | "bad_score" | "timeout" | "worker_died"
    message: str  # the traceback, or what happened
    started: float = (
        0.0  # timeouts: when the sample started (time.monotonic, the same clock in every process)
    )


class _Output:
    """A worker's stdout and stderr, read by a thread: the first SHOWN_BYTES go on to this process's stderr,
    the rest is counted, and the last TAIL_BYTES are written to `path` once the worker has ended, so a
    reward function printing in a loop can neither flood the run's log nor block on a full pipe."""

    def __init__(self, stream, name: str, path: str | None):
        self.stream, self.name, self.path = stream, name, path
        self.total, self.tail = 0, bytearray()
        self.thread = threading.Thread(target=self._read, daemon=True, name=f"output of {name}")
        self.thread.start()

    def _read(self) -> None:
        while chunk := self.stream.read1(65536):
            shown = max(0, min(len(chunk), SHOWN_BYTES - self.total))
            if shown:
                sys.stderr.write(chunk[:shown].decode(errors="replace"))
                sys.stderr.flush()
            self.total += len(chunk)
            if shown < len(chunk) and self.total - len(chunk) <= SHOWN_BYTES:
                where = f"; its last {TAIL_BYTES // 1024} KiB go to {self.path}" if self.path else ""
                print(
                    f"\n{self.name}: output past {SHOWN_BYTES // 1024} KiB is not shown{where}",
                    file=sys.stderr,
                )
            self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        self.stream.close()
        if self.path and self.total:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "wb") as f:
                f.write(self.tail)


class _Worker:
    """One reward worker process and the chunk it is working on."""

    def __init__(self, cfg: RewardConfig, registered: bytes | None, output_dir: str | None = None):
        parent, child = Pipe(duplex=True)
        self.workdir, self.workdir_lock = locked_workdir()  # its working dir and TMPDIR
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = [pkg_root] + [p or os.getcwd() for p in sys.path]
        # unbuffered: what a sample's process prints reaches the pipe even when it ends with os._exit
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.rewards._worker", str(child.fileno()), str(os.getpid())],
            pass_fds=(child.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so killing it also kills what it started
        )
        name = f"reward worker {self.proc.pid}"
        path = (
            os.path.join(output_dir, "reward_output", f"worker-{self.proc.pid}.log") if output_dir else None
        )
        self.output = _Output(self.proc.stdout, name, path)
        child.close()
        self.conn = parent
        self.conn.send(
            (cfg.fn, cfg.fn_kwargs, cfg.batched, registered, cfg.preload, cfg.sandbox, self.workdir)
        )
        self.started = time.monotonic()
        self.ready = False
        self.convention: tuple[str, tuple[str, ...]] = (
            "",
            (),
        )  # conventions.py: (convention, required columns)
        self.containment = (
            ""  # "pid_namespace" | "subreaper": how reward code's processes are kept (sandbox.py)
        )
        self.mode = ""  # of the last chunk sent: "seq" | "fork" | "batch"
        self.outstanding: dict[int, Item] = {}  # sent and not yet reported (several fork chunks may add up)
        self.deadline = math.inf  # the backstop: the worker itself times its samples (rewards/_worker.py)

    def send(self, mode: str, chunk: list[Item], timeout_s: float) -> None:
        self.mode = mode
        self.outstanding.update((it[0], it) for it in chunk)
        self.conn.send((mode, chunk) if mode == "batch" else (mode, chunk, timeout_s))
        # a batched call runs in the worker itself, timed only here: reward.timeout_s holds per call, as
        # a user's batched function is one call, however many samples it takes. Otherwise the worker
        # reports a sample (or its timeout) at least every timeout_s, and this backstop moves with them
        self.deadline = time.monotonic() + timeout_s + (0.0 if mode == "batch" else BACKSTOP_S)

    def heard(self, timeout_s: float) -> None:
        """A message came: the backstop moves (or goes, when nothing is outstanding)."""
        if not self.outstanding:
            self.deadline = math.inf
        elif self.mode != "batch":
            self.deadline = time.monotonic() + timeout_s + BACKSTOP_S

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.conn.close()
        self._clean()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout=2)
            self.conn.close()
            self._clean()
        except Exception:
            self.kill()

    def _clean(self) -> None:
        self.output.thread.join(timeout=1.0)  # its tail written (reward code's orphans may hold the pipe)
        shutil.rmtree(self.workdir, ignore_errors=True)
        os.close(self.workdir_lock)
        remove_cgroup(self.proc.pid)


def locked_workdir(root: str | None = None) -> tuple[str, int]:
    """A fresh worker's directory and the descriptor holding its lock for as long as this process lives.
    Created under a hidden name and renamed once locked, so `sweep_orphaned_workdirs` never sees it unlocked."""
    hidden = tempfile.mkdtemp(prefix="." + WORKDIR_PREFIX, dir=root)
    fd = os.open(hidden, os.O_RDONLY)  # not inherited by the worker (Python's descriptors are close-on-exec)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    path = os.path.join(os.path.dirname(hidden), os.path.basename(hidden)[1:])
    os.rename(hidden, path)
    return path, fd


def sweep_orphaned_workdirs(root: str | None = None) -> int:
    """Remove the working directories of pools whose process died without cleaning up (a killed driver:
    its workers die with it, _worker.die_with_parent, and cannot either): the kernel drops a dead process's
    locks, so a directory whose lock can be taken has no owner. Returns how many were removed."""
    removed = 0
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), WORKDIR_PREFIX + "*")):
        if not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # gone meanwhile, or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its pool is alive
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        finally:
            os.close(fd)
    return removed


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


class WorkerPool:
    """Persistent workers; `run` feeds them chunks and enforces the per-sample timeout."""

    def __init__(
        self, cfg: RewardConfig, n: int, registered: bytes | None = None, output_dir: str | None = None
    ):
        """registered: the user-registered functions cfg.fn may name, pickled by value (registry.py);
        output_dir: where each worker's last output is kept (the run directory), None: nowhere."""
        self.cfg, self.registered, self.output_dir = cfg, registered, output_dir
        self.pending: deque = deque()  # (mode, chunk) not yet sent, of the batch being scored
        self.batched = False
        self.retried: set[int] = set()  # samples of the batch being scored re-queued once already
        self.replaced = 0  # workers replaced (died, stopped, timed out) since the pool started
        sweep_orphaned_workdirs()
        self.workers = [self._spawn() for _ in range(n)]
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)

    def _spawn(self) -> _Worker:
        return _Worker(self.cfg, self.registered, self.output_dir)

    def close(self) -> None:
        self._finalizer()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.replaced += 1
        self.workers[self.workers.index(w)] = self._spawn()

    def wait_ready(self) -> tuple[str, tuple[str, ...]]:
        """Block until every worker has imported the reward function; -> its calling convention and
        the dataset columns it requires (rewards/conventions.py).
        An import that raises, exits or outlasts reward.startup_timeout_s is a RewardSpecError."""
        while not all(w.ready for w in self.workers):
            starting = [w for w in self.workers if not w.ready]
            timeout = min(w.started for w in starting) + self.cfg.startup_timeout_s - time.monotonic()
            for conn in wait([w.conn for w in starting], timeout=max(0.0, timeout)):
                w = next(w for w in starting if w.conn is conn)
                self._receive(w, {}, [])
            self._check_startup()
        return self.workers[0].convention

    def _check_startup(self) -> None:
        for w in self.workers:
            if not w.ready and time.monotonic() > w.started + self.cfg.startup_timeout_s:
                self.close()
                raise RewardSpecError(
                    f"reward.fn={self.cfg.fn!r}: the reward worker did not finish importing it within "
                    f"{self.cfg.startup_timeout_s:g}s (code at module level that never returns?); raise "
                    "reward.startup_timeout_s if the import is only slow"
                )

    def _receive(self, w: _Worker, scores: dict, errors: list) -> None:
        """Handle everything `w` has sent; a dead worker's samples in flight are retried (or, starting,
        the run fails)."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv(), scores, errors)
        except (EOFError, OSError):
            self._died(w, errors)

    def _send(self, w: _Worker, mode: str, chunk: list[Item], errors: list) -> None:
        """Give `w` a chunk; a worker that died while idle (killed, OOM) is found here, by its broken pipe."""
        try:
            w.send(mode, chunk, self.cfg.timeout_s)
        except OSError:  # BrokenPipeError, ConnectionResetError: the chunk is now `w`'s outstanding
            self._died(w, errors)

    def _died(self, w: _Worker, errors: list) -> None:
        code = w.proc.wait()
        if not w.ready:
            self.close()
            raise RewardSpecError(
                f"reward.fn={self.cfg.fn!r}: the reward worker exited with code {code} while importing it"
            ) from None
        self._retry(w, "worker_died", f"the worker process died (exit code {code})", errors)

    def _retry(self, w: _Worker, kind: str, message: str, errors: list) -> None:
        """The worker itself failed, not a sample (user code runs in its children): `w` is replaced and
        its samples in flight are queued again, each once; a sample that was already retried fails."""
        again = [it for i, it in w.outstanding.items() if i not in self.retried]
        w.outstanding = {i: it for i, it in w.outstanding.items() if i in self.retried}
        self.retried.update(it[0] for it in again)
        if again:
            mode = "batch" if self.batched else "seq"
            self.pending.appendleft((mode, again))
        self._fail(w, kind, f"{message}, on this sample's retry", errors)

    def _fail(self, w: _Worker, kind: str, message: str, errors: list) -> None:
        """Every sample `w` still owes fails (it died, or its backstop passed); `w` is replaced."""
        started = time.monotonic() - self.cfg.timeout_s
        errors.extend(RewardError(i, "", kind, message, started) for i in w.outstanding)
        if kind == "timeout":
            self._go_parallel()
        self._replace(w)

    def _go_parallel(self) -> None:
        """A sample hangs (or may): the queued samples are re-cut into one fork chunk per worker, sent
        at once even to busy workers, so that each sample starts now in a process of its own."""
        items = [it for _, chunk in self.pending for it in chunk]
        if self.batched or not items:
            return
        size = math.ceil(len(items) / len(self.workers))
        self.pending = deque(("fork", items[i : i + size]) for i in range(0, len(items), size))

    def run(self, items: list[Item], batched: bool) -> tuple[dict[int, float], list]:
        cfg, n_workers, self.batched = self.cfg, len(self.workers), batched
        size = cfg.chunk_size or max(1, math.ceil(len(items) / (n_workers * (1 if batched else 4))))
        mode = "batch" if batched else "seq"
        self.pending = deque((mode, items[i : i + size]) for i in range(0, len(items), size))
        self.retried = set()
        scores: dict[int, float] = {}
        errors: list = []
        while len(scores) + len(errors) < len(items):
            for w in list(self.workers):
                if w.ready and self.pending and (not w.outstanding or self.pending[0][0] == "fork"):
                    self._send(w, *self.pending.popleft(), errors)
            now = time.monotonic()
            deadlines = [w.deadline if w.ready else w.started + cfg.startup_timeout_s for w in self.workers]
            by_conn = {w.conn: w for w in self.workers}
            for conn in wait(list(by_conn), timeout=max(0.0, min(deadlines) - now)):
                self._receive(by_conn[conn], scores, errors)
            now = time.monotonic()
            for w in list(self.workers):
                if w.outstanding and now > w.deadline:
                    self._silent(w, errors)
            self._check_startup()
        return scores, errors

    def _silent(self, w: _Worker, errors: list) -> None:
        """`w`'s backstop passed. A batched call runs in the worker itself: its samples timed out. Otherwise
        the worker times its own samples, so its silence means the worker itself is stuck (stopped, or
        starved): its samples in flight are retried like a dead worker's."""
        timeout_s = self.cfg.timeout_s
        if w.mode == "batch":
            message = f"the batched call gave no result within {timeout_s:g}s; the worker was killed"
            self._fail(w, "timeout", message, errors)
        else:
            message = f"the worker sent nothing for {timeout_s + BACKSTOP_S:g}s and was killed"
            self._retry(w, "timeout", message, errors)

    def _handle(self, w: _Worker, msg: tuple, scores: dict, errors: list) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready, w.convention, w.containment = True, tuple(msg[2]), msg[3]
        elif kind == "init_error":
            self.close()
            raise RewardSpecError(f"reward.fn={self.cfg.fn!r}: {msg[1]}")
        elif kind == "batch":
            _, idx, values, tb = msg
            if values is None:
                errors.extend(RewardError(i, "", "exception", tb) for i in idx)
            else:
                scores.update(zip(idx, values))
            for i in idx:
                w.outstanding.pop(i, None)
        elif kind == "spill":  # a sample is slow enough that it may hang: start the queued ones now
            self._go_parallel()
        elif msg[1] in w.outstanding:  # one sample done: "ok" | "err" | "timeout" | "died"
            i = msg[1]
            item = w.outstanding.pop(i)
            if kind == "ok":
                scores[i] = msg[2]
            else:
                error_kind = {"err": "exception", "died": "worker_died"}.get(kind, kind)
                started, message = 0.0, msg[2]
                if kind in ("timeout", "died"):
                    message += f" (response starts {str(item[2])[:80]!r})"
                    started = msg[3] if kind == "timeout" else 0.0
                errors.append(RewardError(i, "", error_kind, message, started))
                if kind == "timeout":
                    self._go_parallel()
        w.heard(self.cfg.timeout_s)
