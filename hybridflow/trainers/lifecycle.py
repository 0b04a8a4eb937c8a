"""A run's life around the step loop: the embedded Ray cluster, stop signals, automatic recovery,
and the checks made before any worker starts (finished run, resume compatibility).

How these behave for a user is in docs/operations.md. In short:
- `start_ray`: an embedded cluster listens on 127.0.0.1 only, with Ray token auth (a fresh random
  token per run) and no dashboard unless resources.ray_dashboard; resources.ray_address joins a real
  cluster instead (its own network and auth settings apply).
- `StopSignals`: the first SIGTERM/SIGINT asks the loop to stop after the step in flight and its
  checkpoint; a second one (or trainer.stop_grace_s passing) abandons them, naming the call the driver
  was waiting for. Either way the CLI shuts everything down and exits 128 + signal. The driver never
  blocks in Ray for long (controller/future.py waits in slices), so a hung worker cannot delay this.
- `is_recoverable`: which worker failures the trainer answers by restarting its worker groups from the
  last checkpoint (trainer.max_restarts): a dead process or a failed/timed-out collective; `restart`
  first waits for lost devices or shrinks dp (elastic.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import ray

from hybridflow.controller import WorkerDiedError, WorkerError, ensure_ray, future
from hybridflow.controller.resource_pool import uses_cuda
from hybridflow.trainers import cluster_loss, supervised

log = logging.getLogger(__name__)


class RunFinished(Exception):
    """The run directory already holds the final checkpoint: nothing to train (the CLI exits 0)."""


class Preempted(Exception):
    """The run stopped on a signal after its step and checkpoint (the CLI exits 128 + signum)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {where}")


class Abandoned(BaseException):
    """A second stop signal (or the grace period ran out): unwind now, like KeyboardInterrupt."""

    def __init__(self, signum: int, why: str = "", waiting: str = ""):
        self.signum = signum
        why = why or f"{signal.Signals(signum).name} again"
        where = f" while waiting for {waiting}" if waiting else ""
        super().__init__(f"{why}: the step and its checkpoint were abandoned{where}")


# ---- the embedded cluster ----------------------------------------------------------------------------
def start_ray(cfg, num_devices: int) -> None:
    """Join resources.ray_address, or start an embedded local cluster with room for every device."""
    if ray.is_initialized():
        return
    r = cfg.resources
    if r.ray_address:
        ensure_ray(address=r.ray_address, log_to_driver=False)
    else:
        if ACTIVE is not None:  # `hybridflow train`: this process is the run's, so is everything below it
            start_reaper()
        start_local_ray(
            max(r.ray_num_cpus or os.cpu_count() or 1, num_devices),
            r.ray_dashboard,
            compute_on_cpu=not uses_cuda(r.device),
        )
        supervised.report(cluster=cluster_loss.cluster_pids())  # the supervisor watches them
    if ACTIVE is not None:
        ACTIVE.install()  # ray.init replaced the SIGTERM handler with sys.exit


def start_local_ray(num_cpus: int, dashboard: bool = False, **init_kwargs) -> None:
    """An embedded single-host Ray cluster on 127.0.0.1 with token auth (see `_local_only`)."""
    _local_only()
    init_kwargs.setdefault("log_to_driver", False)
    ensure_ray(
        address="local",  # our own cluster, even when `ray start` left a cluster's address in /tmp/ray
        num_cpus=num_cpus,
        include_dashboard=dashboard,
        dashboard_host="127.0.0.1",
        **init_kwargs,
    )


def _local_only() -> None:
    """Environment of an embedded cluster (inherited by every Ray process it starts): node address
    127.0.0.1, so Ray's gRPC servers, agents and metrics endpoints bind to loopback (Ray's single-host
    mode); token auth with a fresh token; gloo on the loopback interface; no usage reporting."""
    import ray._private.ray_constants as ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at import time; this process imported Ray already
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    previous = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    try:  # Ray's config and token cache were read at import time
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as e:  # a Ray without token auth: loopback only
        log.warning("Ray token auth unavailable (%s); the embedded cluster listens on 127.0.0.1 only", e)
        for k, v in previous.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        os.environ["RAY_AUTH_MODE"] = "disabled"


_REAPER = None


def start_reaper() -> None:
    """hybridflow/reaper.py: kills the run's processes if this process dies without cleaning up."""
    global _REAPER
    if _REAPER is None and os.path.isdir("/proc"):
        import subprocess

        cmd = [sys.executable, "-m", "hybridflow.reaper", str(os.getpid())]
        _REAPER = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True)


def reaper_pid() -> int | None:
    return _REAPER.pid if _REAPER is not None else None


def stop_reaper() -> None:
    """Normal exit, after shutting Ray down: the reaper kills stragglers (Ray's agents exit late) and ends."""
    global _REAPER
    if _REAPER is not None:
        _REAPER.stdin.close()
        try:
            _REAPER.wait(timeout=30)
        except Exception:  # noqa: BLE001 — never let the helper hold the exit up
            _REAPER.kill()
        _REAPER = None


# ---- stop signals ------------------------------------------------------------------------------------
class StopSignals:
    """SIGTERM/SIGINT handling of one `hybridflow train` (a context manager; see the module doc).
    grace_s: after the first signal, how long the step and its checkpoint may take (0 = no limit).

    Only `running()`, the run's body, can be abandoned. A handler may fire between any two bytecodes, so
    the body's end is where abandoning stops: an Abandoned raised as it ends is still the body's, caught
    with its outcomes, and a signal after it cannot interrupt the cleanup (it only notes the signal)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, grace_s: float = 0.0):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.abandoned = False
        self.live = False  # inside running()
        self._timer: threading.Timer | None = None
        self._previous: dict = {}
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_fd = -1

    def __enter__(self) -> StopSignals:
        global ACTIVE
        self._previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        if threading.current_thread() is not threading.main_thread():
            self._previous = {}
        self.install()
        future.add_wait_check(self.check)
        ACTIVE = self
        return self

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; a caller elsewhere keeps its handlers
        for s in self.SIGNALS:
            signal.signal(s, self._handle)
        if self._wakeup is None:
            self._wakeup = socket.socketpair()
            for sock in self._wakeup:
                sock.setblocking(False)
            self._previous_fd = signal.set_wakeup_fd(self._wakeup[1].fileno(), warn_on_full_buffer=False)

    def _deliveries(self) -> int:
        """How many stop signals arrived since the last handler call (at least this one). Python runs a
        handler once for signals that arrive while the main thread is inside one C call (a Ray wait
        checks for them once a second), so two quick SIGTERMs would read as one; its C handler writes
        a byte per delivery to the wakeup fd, which counts them."""
        if self._wakeup is None:  # installed off the main thread: Python's own handlers, no count
            return 1
        n = 0
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            while chunk := self._wakeup[0].recv(64):
                n += sum(b in self.SIGNALS for b in chunk)
        return max(n, 1)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The run's body: a second signal (or the grace period passing) here raises Abandoned."""
        self.live = True
        try:
            yield
        finally:
            self._body_over()

    def _body_over(self) -> None:
        """Signals are only noted from now on; an abandonment noted in a Ray wait just as the body ended,
        or a grace period still running, comes too late."""
        self.live = False
        self._pending = None
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        for _ in range(self._deliveries()):
            self._one(signum)

    def _one(self, signum: int) -> None:
        if not self.live:  # before the body (it stops after its first step) or shutting down already
            self.signum = self.signum or signum
            return
        if self.abandoned:
            return
        if self.signum is None:
            self.signum = signum
            limit = f" within {self.grace_s:g} s" if self.grace_s else ""
            print(
                f"hybridflow train: {signal.Signals(signum).name}: finishing the step and saving{limit} "
                "(send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            if self.grace_s:
                self._timer = threading.Timer(self.grace_s, self._grace_over, (signum,))
                self._timer.daemon = True
                self._timer.start()
            return
        self.abandoned = True
        abandoned = Abandoned(signum, self._why, future.waiting_for())
        if not future.in_ray_wait():
            raise abandoned
        self._pending = abandoned  # raised by check() once Ray's wait has returned

    _pending: Abandoned | None = None

    def check(self) -> None:
        """Raise the abandonment a signal noted while the driver was inside Ray (future.py's waits)."""
        if self._pending is not None:
            abandoned, self._pending = self._pending, None
            raise abandoned

    _why = ""

    def _grace_over(self, signum: int) -> None:
        self._why = f"trainer.stop_grace_s={self.grace_s:g} passed after {signal.Signals(signum).name}"
        os.kill(os.getpid(), signum)

    def __exit__(self, *exc) -> None:
        global ACTIVE
        self._body_over()
        future.remove_wait_check(self.check)
        ACTIVE = None
        for s, h in self._previous.items():
            signal.signal(s, h)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for sock in self._wakeup:
                sock.close()
            self._wakeup = None


ACTIVE: StopSignals | None = None


def stop_requested() -> int | None:
    """The signal that asked this run to stop, if any."""
    return None if ACTIVE is None else ACTIVE.signum


# ---- recovery ------------------------------------------------------------------------------------------
_COLLECTIVE_FAILURES = (
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "Connection closed by peer",
    "Connection reset by peer",
    "timed out",
    "Timed out",
)


def is_recoverable(error: BaseException) -> bool:
    """A dead worker process, or a worker failing inside a collective (a peer died, a timeout)."""
    if isinstance(error, WorkerDiedError):
        return True
    return isinstance(error, WorkerError) and any(t in error.remote_traceback for t in _COLLECTIVE_FAILURES)


def restart(trainer, error: Exception, history: list[dict]) -> None:
    """After a recoverable failure: new worker groups, then the state of the last checkpoint this run
    wrote or loaded (or of its start when there is none); history loses the steps after it."""
    from hybridflow.checkpoint import restore_rng_state
    from hybridflow.trainers.elastic import fit_devices
    from hybridflow.trainers.placement import build_worker_groups, shutdown

    trainer.restarts += 1
    supervised.report(restarts=trainer.restarts)
    n = f"{trainer.restarts}/{trainer.cfg.trainer.max_restarts}"
    reason = str(error).splitlines()[0]
    print(
        f"hybridflow train: restart {n} at step {trainer.global_step}: {reason}", file=sys.stderr, flush=True
    )
    shutdown(trainer.groups, trainer.pools)
    trainer.groups, trainer.pools = {}, []
    fit_devices(trainer)  # a node gone: wait for it, or continue with fewer dp ranks (elastic.py)
    trainer.groups, trainer.pools = build_worker_groups(trainer.cfg, trainer.placement, trainer.roles())
    trainer.global_step = 0
    if trainer._restore_point is not None:
        require = [*trainer.checkpoint_parts(), "trainer_state.json"]
        trainer.ckpt.validate(trainer._restore_point, require=require)
        trainer.load_checkpoint(trainer._restore_point)
    else:
        loader, extra, rng = trainer._initial
        if loader is not None:
            trainer.train_loader.load_state_dict(loader)
        trainer.load_extra_state(extra)
        restore_rng_state(rng)
    history[:] = [h for h in history if h["step"] <= trainer.global_step]
    trainer.timers.pop()
    print(
        f"hybridflow train: resumed from step {trainer.global_step} (restart {n})",
        file=sys.stderr,
        flush=True,
    )
