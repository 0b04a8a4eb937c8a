"""Scores a batch of responses with a rule reward function: in worker processes, with a per-sample timeout.

Why processes: a user reward function may hang (a regex on adversarial text, sympy on a pathological
expression) or crash the interpreter; only a process can be killed. Why persistent workers fed chunks:
cheap rewards (string match, ~10 us) must not pay process start-up or one round trip per sample, so
each worker receives a chunk of samples and streams one small result message per sample back; the
parent restarts a sample's clock at each message, so the timeout is per sample, not per chunk.

Failures are never silent: an exception (sample id + traceback), a bad return value, a timeout (the
worker is killed and replaced; the rest of its chunk is re-queued) or a dead worker each yield a
`RewardError`, logged as a warning, counted in the metrics, and scored per `on_error`.

num_workers=0 scores in the calling process, for built-in (trusted) rewards only: a user function
still gets one worker so that its timeout can be enforced.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.rewards.registry import Item, absolute_spec, is_builtin_spec, load_reward_fn, run_per_sample

if TYPE_CHECKING:
    import torch

    from hybridflow.batch import Batch

__all__ = ["RewardConfig", "RewardError", "RewardFunctionError", "RewardResult", "RewardExecutor"]

logger = logging.getLogger("hybridflow.rewards")


@dataclass
class RewardConfig:
    """How rule rewards are computed. Field names match `reward` in the config tree (config/schema.py)."""

    # "" = by each sample's data_source; a registered name ("gsm8k", "math", "synthetic:arithmetic");
    # "path/to/file.py:function_name"; or "package.module:function_name".
    fn: str = ""
    # Extra keyword arguments for the reward function (e.g. {"method": "flexible"} for gsm8k).
    fn_kwargs: dict[str, Any] = field(default_factory=dict)
    # True/False force the batched/per-sample convention; None reads the function's `batched` attribute.
    batched: bool | None = None
    # Seconds one sample may take (a batched call gets timeout_s * its chunk size). Hangs are killed.
    timeout_s: float = 10.0
    # Worker processes. 0 = score built-in rewards in-process (user functions still get one worker).
    num_workers: int = 1
    # On a failed sample: "zero" -> 0.0, "score" -> error_score, a number -> that score, "raise" -> abort
    # after the batch with every failure listed.
    on_error: str | float = "score"
    error_score: float = 0.0
    # Samples per chunk sent to a worker; 0 = about 4 chunks per worker (per-sample) or 1 (batched).
    chunk_size: int = 0
    # How many failures per batch are logged with their full traceback (all are counted and returned).
    max_logged_errors: int = 5
    # Seconds a worker may take to start and import the reward function before the run is aborted.
    startup_timeout_s: float = 120.0

    @classmethod
    def from_any(cls, cfg: Any) -> RewardConfig:
        """Build from any object with some of these attributes (e.g. the config tree's `reward` node)."""
        names = cls.__dataclass_fields__
        return cls(**{k: getattr(cfg, k) for k in names if hasattr(cfg, k)})


@dataclass
class RewardError:
    index: int  # position in the batch
    sample_id: str  # the index and, when known, the sample's uid
    kind: str  # "exception" | "timeout" | "worker_died"
    message: str  # the traceback, or what happened


class RewardFunctionError(RuntimeError):
    """Raised with on_error='raise'; `.errors` lists every failed sample."""

    def __init__(self, errors: list[RewardError]):
        self.errors = errors
        first = errors[0]
        super().__init__(
            f"reward function failed on {len(errors)} sample(s); first: sample {first.sample_id} "
            f"({first.kind}):\n{first.message}"
        )


@dataclass
class RewardResult:
    scores: np.ndarray  # (B,) float32, failed samples scored per on_error
    errors: list[RewardError]
    metrics: dict[str, float]

    def token_level_scores(self, response_mask: torch.Tensor) -> torch.Tensor:
        """Scores placed on each response's last valid token: (B, L), the `token_level_scores` field."""
        import torch

        from hybridflow.algorithms.utils import place_score_on_last_token

        return place_score_on_last_token(torch.from_numpy(self.scores), response_mask)


def _fallback_score(on_error: str | float, error_score: float) -> float | None:
    """The score for a failed sample, or None for 'raise'."""
    if on_error == "raise":
        return None
    if on_error == "zero":
        return 0.0
    if on_error == "score":
        return float(error_score)
    try:
        return float(on_error)
    except (TypeError, ValueError):
        raise ValueError(f"reward on_error={on_error!r}: use 'zero', 'score', 'raise' or a number") from None


class _Worker:
    """One reward worker process and the chunk it is working on."""

    def __init__(self, spec: str, fn_kwargs: dict, batched: bool | None):
        parent, child = Pipe(duplex=True)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = [pkg_root] + [p or os.getcwd() for p in sys.path]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.rewards._worker", str(child.fileno())],
            pass_fds=(child.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so killing it also kills what it started
        )
        child.close()
        self.conn = parent
        self.conn.send((spec, fn_kwargs, batched))
        self.started = time.monotonic()
        self.ready = False
        self.chunk: list[Item] | None = None
        self.next = 0  # position in chunk of the sample being scored
        self.deadline = math.inf

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(timeout=2)
            self.conn.close()
        except Exception:
            self.kill()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()
    workers.clear()


class _WorkerPool:
    """Persistent workers; `run` feeds them chunks and enforces the per-sample timeout."""

    def __init__(self, cfg: RewardConfig, n: int):
        self.cfg = cfg
        self.workers = [self._spawn() for _ in range(n)]
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)

    def _spawn(self) -> _Worker:
        return _Worker(self.cfg.fn, self.cfg.fn_kwargs, self.cfg.batched)

    def close(self) -> None:
        self._finalizer()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self.workers[self.workers.index(w)] = self._spawn()

    def run(self, items: list[Item], batched: bool) -> tuple[dict[int, float], list[RewardError]]:
        cfg, n_workers = self.cfg, len(self.workers)
        size = cfg.chunk_size or max(1, math.ceil(len(items) / (n_workers * (1 if batched else 4))))
        pending = deque(items[i : i + size] for i in range(0, len(items), size))
        scores: dict[int, float] = {}
        errors: list[RewardError] = []

        def fail(w: _Worker, kind: str, message: str) -> None:
            # The sample(s) in flight fail; the rest of the chunk goes back to the queue.
            if w.chunk is None:  # died between chunks: nothing was lost, just replace it
                self._replace(w)
                return
            failed = w.chunk if batched else [w.chunk[w.next]]
            preview = "" if batched else f" (response starts {failed[0][2][:80]!r})"
            errors.extend(RewardError(it[0], "", kind, message + preview) for it in failed)
            rest = [] if batched else w.chunk[w.next + 1 :]
            if rest:
                pending.appendleft(rest)
            self._replace(w)

        while len(scores) + len(errors) < len(items):
            now = time.monotonic()
            for w in self.workers:
                if w.ready and w.chunk is None and pending:
                    w.chunk, w.next = pending.popleft(), 0
                    w.conn.send(w.chunk)
                    w.deadline = now + cfg.timeout_s * (len(w.chunk) if batched else 1)
            deadlines = [w.deadline if w.ready else w.started + cfg.startup_timeout_s for w in self.workers]
            by_conn = {w.conn: w for w in self.workers}
            for conn in wait(list(by_conn), timeout=max(0.0, min(deadlines) - now)):
                w = by_conn[conn]
                try:
                    while conn.poll():
                        self._handle(w, conn.recv(), scores, errors, batched)
                except (EOFError, OSError):
                    if not w.ready:
                        raise RuntimeError(
                            f"a reward worker exited while starting (code {w.proc.wait()})"
                        ) from None
                    fail(w, "worker_died", f"the worker process died (exit code {w.proc.wait()})")
            now = time.monotonic()
            for w in list(self.workers):
                if w.chunk is not None and now > w.deadline:
                    limit = cfg.timeout_s * (len(w.chunk) if batched else 1)
                    fail(w, "timeout", f"no result within {limit:g}s; the worker was killed")
                elif not w.ready and now > w.started + cfg.startup_timeout_s:
                    raise RuntimeError(f"a reward worker did not start within {cfg.startup_timeout_s}s")
        return scores, errors

    def _handle(self, w: _Worker, msg: tuple, scores: dict, errors: list, batched: bool) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "init_error":
            raise RuntimeError(f"a reward worker could not load reward fn {self.cfg.fn!r}:\n{msg[1]}")
        elif kind == "batch":
            _, idx, values, tb = msg
            if values is None:
                errors.extend(RewardError(i, "", "exception", tb) for i in idx)
            else:
                scores.update(zip(idx, values))
            w.chunk = None
        else:  # "ok" / "err": one sample done, the next one's clock starts now
            if kind == "ok":
                scores[msg[1]] = msg[2]
            else:
                errors.append(RewardError(msg[1], "", "exception", msg[2]))
            w.next += 1
            w.deadline = time.monotonic() + self.cfg.timeout_s
            if w.next == len(w.chunk):
                w.chunk, w.deadline = None, math.inf


class RewardExecutor:
    """Scores batches with a rule reward. Reuse one executor across steps (workers persist); `close()` it.

    Usage:
        with RewardExecutor(RewardConfig(fn="my_reward.py:score", num_workers=2)) as ex:
            result = ex.score(data_sources, responses, ground_truths)   # -> RewardResult
    """

    def __init__(self, config: RewardConfig | None = None, **overrides: Any):
        cfg = config or RewardConfig()
        # Workers get an absolute path: they resolve the spec themselves, possibly after a chdir.
        cfg = RewardConfig(**{**cfg.__dict__, **overrides, "fn": absolute_spec(overrides.get("fn", cfg.fn))})
        if cfg.num_workers < 0 or cfg.timeout_s <= 0:
            raise ValueError(
                f"reward num_workers must be >= 0 and timeout_s > 0 (got {cfg.num_workers}, {cfg.timeout_s})"
            )
        self.fallback = _fallback_score(cfg.on_error, cfg.error_score)  # validates on_error early
        # Resolve here too, so a typo in the spec fails now with a clear message, not inside a worker.
        self.fn, declared = load_reward_fn(cfg.fn)
        self.batched = declared if cfg.batched is None else cfg.batched
        self.cfg = cfg
        self.in_process = cfg.num_workers == 0 and is_builtin_spec(cfg.fn)
        self._pool: _WorkerPool | None = None

    # ---- public --------------------------------------------------------------------------------
    def score(
        self,
        data_sources: Sequence | str,
        solution_strs: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence | None = None,
        sample_ids: Sequence | None = None,
    ) -> RewardResult:
        """Score B samples. data_sources may be one string for all. Returns scores (B,), errors, metrics."""
        n = len(solution_strs)
        if isinstance(data_sources, str):
            data_sources = [data_sources] * n
        extra_infos = [None] * n if extra_infos is None else extra_infos
        lengths = {
            "data_sources": len(data_sources),
            "ground_truths": len(ground_truths),
            "extra_infos": len(extra_infos),
        }
        if any(v != n for v in lengths.values()):
            raise ValueError(f"reward inputs disagree on the batch size: solution_strs={n}, {lengths}")
        items = [(i, data_sources[i], solution_strs[i], ground_truths[i], extra_infos[i]) for i in range(n)]
        start = time.perf_counter()
        scores_by_idx, errors = self._run_in_process(items) if self.in_process else self._run_in_pool(items)
        elapsed = time.perf_counter() - start

        for e in errors:
            e.sample_id = str(sample_ids[e.index]) if sample_ids is not None else str(e.index)
        errors.sort(key=lambda e: e.index)
        self._report(errors, n)
        if errors and self.fallback is None:
            raise RewardFunctionError(errors)
        scores = np.full(n, np.nan if self.fallback is None else self.fallback, dtype=np.float32)
        for i, s in scores_by_idx.items():
            scores[i] = s
        n_timeouts = sum(e.kind == "timeout" for e in errors)
        metrics = {
            "reward/num_errors": float(len(errors) - n_timeouts),
            "reward/num_timeouts": float(n_timeouts),
            "reward/fn_time_s": elapsed,
        }
        return RewardResult(scores, errors, metrics)

    def score_batch(self, batch: Batch) -> RewardResult:
        """Score a Batch from its non-tensor fields: response_text, ground_truth (or reward_model
        dicts), data_source, optional extra_info; sample ids are "index (uid=...)" when uid is present."""
        nt = batch.non_tensors
        if "response_text" not in nt:
            raise KeyError("score_batch needs non_tensors['response_text'] (decode the responses first)")
        if "ground_truth" in nt:
            truths = list(nt["ground_truth"])
        elif "reward_model" in nt:
            truths = [rm.get("ground_truth") for rm in nt["reward_model"]]
        else:
            raise KeyError(
                "score_batch needs non_tensors['ground_truth'] or ['reward_model'] with a ground_truth"
            )
        n = len(truths)
        sources = list(nt["data_source"]) if "data_source" in nt else [""] * n
        extras = list(nt["extra_info"]) if "extra_info" in nt else None
        ids = [f"{i} (uid={u})" for i, u in enumerate(nt["uid"])] if "uid" in nt else None
        return self.score(sources, list(nt["response_text"]), truths, extras, ids)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------
    def _run_in_process(self, items: list[Item]) -> tuple[dict[int, float], list[RewardError]]:
        scores, errors = {}, []
        for item in items:
            try:
                scores[item[0]] = run_per_sample(self.fn, item, self.cfg.fn_kwargs)
            except Exception:
                errors.append(RewardError(item[0], "", "exception", traceback.format_exc()))
        return scores, errors

    def _run_in_pool(self, items: list[Item]) -> tuple[dict[int, float], list[RewardError]]:
        if not items:
            return {}, []
        if self._pool is None:
            self._pool = _WorkerPool(self.cfg, max(1, self.cfg.num_workers))
        try:
            return self._pool.run(items, self.batched)
        except BaseException:
            # Workers may still be busy with chunks of this batch; their late results must not leak
            # into the next call, so the pool is discarded.
            self.close()
            raise

    def _report(self, errors: list[RewardError], n: int) -> None:
        for e in errors[: self.cfg.max_logged_errors]:
            logger.warning("reward function failed on sample %s (%s):\n%s", e.sample_id, e.kind, e.message)
        if errors:
            policy = "raising" if self.fallback is None else f"scored {self.fallback:g}"
            logger.warning(
                "reward function failed on %d of %d samples (%d timeouts; %s); first %d shown above",
                len(errors), n, sum(e.kind == "timeout" for e in errors), policy,
                min(len(errors), self.cfg.max_logged_errors),
            )  # fmt: skip
