"""Scores a batch of responses with a rule reward function: in worker processes, with a per-sample timeout.

Why processes: a user reward function may hang (a regex on adversarial text, sympy on a pathological
expression), call sys.exit or crash the interpreter; only a process can be killed. The workers and
their scheduling (concurrent timeouts) are in pool.py. User reward code is imported only there, never
in this process: a user spec is checked for form here, then the workers are started at once, so a
module that raises, exits or hangs at import fails the run before any training worker starts.

Failures are never silent: an exception (sample id + traceback), a bad return value, a score that is
not finite as float32 or beyond reward.max_abs_score, a timeout (the worker is killed and replaced) or
a worker lost twice on a sample each yield a `RewardError` (a worker that dies, idle or busy, or falls
silent is replaced and its samples in flight retried once: `reward/worker_restarts`), logged as a
warning, counted in the metrics, and scored per `on_error`; when more than reward.max_error_fraction of a batch fails, `score` raises RewardFailureError
(a one-line RunStopped: hybridflow/errors.py), so a run whose reward is broken cannot finish with exit 0.

num_workers=0 scores in the calling process, for built-in (trusted) rewards only: a user function
still gets one worker so that its timeout can be enforced.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.config.schema import RewardConfig  # the config tree's `reward` section, read as is
from hybridflow.errors import RewardFailureError, RewardFunctionError, RewardSpecError
from hybridflow.rewards.conventions import VERL, calling_convention, missing_columns
from hybridflow.rewards.pool import RewardError, WorkerPool
from hybridflow.rewards.registry import (
    Item,
    Unscored,
    absolute_spec,
    check_spec,
    is_builtin_spec,
    load_reward_fn,
    run_batched,
    run_per_sample,
    user_registered,
)

if TYPE_CHECKING:
    import torch

    from hybridflow.batch import Batch

__all__ = [
    "RewardConfig",
    "RewardError",
    "RewardExecutor",
    "RewardFailureError",
    "RewardFunctionError",
    "RewardResult",
]

logger = logging.getLogger("hybridflow.rewards")


def _last_line(message: str) -> str:
    lines = [x for x in message.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def _describe(errors: list[RewardError], n: int) -> str:
    first, timeouts = errors[0], sum(e.kind == "timeout" for e in errors)
    return (
        f"the reward function failed on {len(errors)} of {n} samples ({timeouts} timeouts); first: sample "
        f"{first.sample_id} ({first.kind}): {_last_line(first.message)}"
    )


@dataclass
class RewardResult:
    scores: np.ndarray  # (B,) float32, failed samples scored per on_error, NaN where the fn returned None
    errors: list[RewardError]
    metrics: dict[str, float]
    extras: list[dict] = field(default_factory=list)  # per sample: the reward fn's other returned keys

    def token_level_scores(self, response_mask: torch.Tensor) -> torch.Tensor:
        """Scores placed on each response's last valid token: (B, L), the `token_level_scores` field."""
        import torch

        from hybridflow.algorithms.utils import place_score_on_last_token

        return place_score_on_last_token(torch.from_numpy(self.scores), response_mask)


def extra_metrics(extras: list[dict]) -> dict[str, float]:
    """reward/extra/<key>/mean over the samples that returned a numeric <key> (bools count as 0/1)."""
    values: dict[str, list[float]] = {}
    for e in extras:
        for k, v in e.items():
            if isinstance(v, (bool, int, float)):
                values.setdefault(k, []).append(float(v))
    return {f"reward/extra/{k}/mean": sum(v) / len(v) for k, v in values.items()}


def _pickled(fns: dict) -> bytes | None:
    """User-registered reward functions, by value, for the worker processes (None: none needed)."""
    if not fns:
        return None
    import cloudpickle

    try:
        return cloudpickle.dumps(fns)
    except Exception as e:
        raise RewardSpecError(
            f"reward functions {sorted(fns)} cannot be sent to the reward worker processes "
            f"({type(e).__name__}: {e}); keep what they use picklable (no open files, locks or sockets)"
        ) from None


def timeout_waits(starts: list[float], timeout_s: float) -> int:
    """How many timeout_s periods the batch waited out one after another: timed-out samples that
    started while an earlier counted one was still running share its wait (1 when they all ran at
    once, 2 when a second group only started after the first timed out, ...)."""
    count, until = 0, -math.inf
    for start in sorted(starts):
        if start >= until:
            count, until = count + 1, start + timeout_s
    return count


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


class RewardExecutor:
    """Scores batches with a rule reward. Reuse one executor across steps (workers persist); `close()` it.

    Usage:
        with RewardExecutor(RewardConfig(fn="my_reward.py:score", num_workers=2)) as ex:
            result = ex.score(data_sources, responses, ground_truths)   # -> RewardResult
    """

    def __init__(
        self,
        config: RewardConfig | None = None,
        columns: set[str] | None = None,
        *,
        output_dir: str | None = None,
        **overrides: Any,
    ):
        """columns: the dataset's columns, when known, against which a TRL function's are checked now;
        output_dir: where each worker's last output is kept (output_dir/reward_output/worker-PID.log)."""
        cfg = config or RewardConfig()
        # Workers get an absolute path: they resolve the spec themselves, possibly after a chdir.
        cfg = RewardConfig(**{**cfg.__dict__, **overrides, "fn": absolute_spec(overrides.get("fn", cfg.fn))})
        if cfg.num_workers < 0 or cfg.timeout_s <= 0:
            raise ValueError(
                f"reward num_workers must be >= 0 and timeout_s > 0 (got {cfg.num_workers}, {cfg.timeout_s})"
            )
        if not 0.0 <= cfg.max_error_fraction <= 1.0 or cfg.max_abs_score <= 0:
            raise ValueError(
                f"reward max_error_fraction must be in [0, 1] and max_abs_score > 0 "
                f"(got {cfg.max_error_fraction}, {cfg.max_abs_score})"
            )
        self.fallback = _fallback_score(cfg.on_error, cfg.error_score)  # validates on_error early
        self.cfg = cfg
        self.in_process = cfg.num_workers == 0 and is_builtin_spec(cfg.fn)
        self._pool: WorkerPool | None = None
        self._registered, self._output_dir = _pickled(user_registered(cfg.fn)), output_dir
        if is_builtin_spec(cfg.fn):  # our own code: resolved here, so a typo fails now
            self.fn, declared = load_reward_fn(cfg.fn)
            batched = declared if cfg.batched is None else cfg.batched
            self.convention, required = calling_convention(self.fn, batched, cfg.fn_kwargs)
        else:  # user code: imported only in the workers, started now so that a bad module fails now
            check_spec(cfg.fn)
            self.fn, self._pool = None, WorkerPool(cfg, max(1, cfg.num_workers), self._registered, output_dir)
            self.convention, required = self._pool.wait_ready()
        self.batched = self.convention != VERL
        refusal = missing_columns(cfg.fn, required, columns)
        if refusal:
            self.close()
            raise RewardSpecError(f"reward.fn={cfg.fn!r}: {refusal}")

    # ---- public --------------------------------------------------------------------------------
    def score(
        self,
        data_sources: Sequence | str,
        solution_strs: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence | None = None,
        sample_ids: Sequence | None = None,
        prompts: Sequence[str] | None = None,
        completion_ids: Sequence[list[int]] | None = None,
        trainer_state: dict | None = None,
    ) -> RewardResult:
        """Score B samples. data_sources may be one string for all. Returns scores (B,), errors, metrics.
        prompts: the rendered prompt texts (a TRL-convention function's `prompts`); completion_ids and
        trainer_state ({global_step, max_steps}): what TRL passes besides (conventions.py)."""
        n = len(solution_strs)
        if isinstance(data_sources, str):
            data_sources = [data_sources] * n
        extra_infos = [None] * n if extra_infos is None else extra_infos
        prompts = [""] * n if prompts is None else prompts
        lengths = {
            "data_sources": len(data_sources),
            "ground_truths": len(ground_truths),
            "extra_infos": len(extra_infos),
            "prompts": len(prompts),
        }
        if any(v != n for v in lengths.values()):
            raise ValueError(f"reward inputs disagree on the batch size: solution_strs={n}, {lengths}")
        token_ids = [None] * n if completion_ids is None else completion_ids
        items = [
            (i, data_sources[i], solution_strs[i], ground_truths[i], extra_infos[i], prompts[i], *more)
            for i, more in enumerate(zip(token_ids, [trainer_state] * n))
        ]
        start = time.perf_counter()
        replaced = self._pool.replaced if self._pool is not None else 0
        scores_by_idx, errors = self._run_in_process(items) if self.in_process else self._run_in_pool(items)
        elapsed = time.perf_counter() - start

        self._check_scores(scores_by_idx, errors)
        for e in errors:
            e.sample_id = str(sample_ids[e.index]) if sample_ids is not None else str(e.index)
        errors.sort(key=lambda e: e.index)
        self._report(errors, n)
        if errors and self.fallback is None:
            raise RewardFunctionError(_describe(errors, n) + " (reward.on_error=raise)", errors)
        if len(errors) > self.cfg.max_error_fraction * n:
            limit = self.cfg.max_error_fraction
            raise RewardFailureError(
                f"{_describe(errors, n)}: more than reward.max_error_fraction={limit:g}; fix the reward "
                "function (the log shows the first tracebacks) or raise reward.max_error_fraction",
                errors,
            )
        scores = np.full(n, np.nan if self.fallback is None else self.fallback, dtype=np.float32)
        for i, s in scores_by_idx.items():
            scores[i] = s
        n_timeouts = sum(e.kind == "timeout" for e in errors)
        waits = timeout_waits([e.started for e in errors if e.kind == "timeout"], self.cfg.timeout_s)
        metrics = {
            "reward/num_errors": float(len(errors) - n_timeouts),
            "reward/error_fraction": len(errors) / max(n, 1),
            "reward/num_timeouts": float(n_timeouts),
            "reward/timeout_waits": float(waits),
            "reward/fn_time_s": elapsed,
            # workers that died, stopped or timed out and were replaced while scoring this batch
            "reward/worker_restarts": float(self._pool.replaced - replaced if self._pool is not None else 0),
        }
        extras = [getattr(scores_by_idx.get(i), "extra", None) or {} for i in range(n)]
        metrics.update(extra_metrics(extras))
        return RewardResult(scores, errors, metrics, extras)

    def score_batch(self, batch: Batch, trainer_state: dict | None = None) -> RewardResult:
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
        prompts = list(nt["prompt_text"]) if "prompt_text" in nt else None
        completion_ids = None
        if "responses" in batch and "response_mask" in batch:
            mask = batch["response_mask"].bool()
            completion_ids = [row[m].tolist() for row, m in zip(batch["responses"], mask)]
        return self.score(
            sources, list(nt["response_text"]), truths, extras, ids, prompts, completion_ids, trainer_state
        )

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
        if self.batched:
            try:
                return dict(
                    zip(
                        (it[0] for it in items),
                        run_batched(self.fn, items, self.cfg.fn_kwargs, self.convention),
                    )
                ), []
            except Exception:
                return {}, [RewardError(it[0], "", "exception", traceback.format_exc()) for it in items]
        for item in items:
            try:
                scores[item[0]] = run_per_sample(self.fn, item, self.cfg.fn_kwargs)
            except Exception:
                errors.append(RewardError(item[0], "", "exception", traceback.format_exc()))
        return scores, errors

    def _check_scores(self, scores: dict[int, float], errors: list[RewardError]) -> None:
        """A score must stay finite as float32 and within max_abs_score; others become errors. Unscored
        (None: the function does not apply) stays NaN, which RuleReward leaves out of its sums."""
        limit = self.cfg.max_abs_score
        scored = {i: s for i, s in scores.items() if not isinstance(s, Unscored)}
        with np.errstate(over="ignore"):  # 1e300 -> inf is exactly what is being checked
            bad = {i: bool(np.isfinite(np.float32(s))) for i, s in scored.items() if not abs(s) <= limit}
            bad.update({i: False for i, s in scored.items() if not np.isfinite(np.float32(s))})
        for i, finite in sorted(bad.items()):
            problem = f"exceeds reward.max_abs_score={limit:g}" if finite else "is not finite as float32"
            message = f"the reward function returned {scores.pop(i)!r}, which {problem}"
            errors.append(RewardError(i, "", "bad_score", message))

    def _run_in_pool(self, items: list[Item]) -> tuple[dict[int, float], list[RewardError]]:
        if not items:
            return {}, []
        if self._pool is None:
            self._pool = WorkerPool(
                self.cfg, max(1, self.cfg.num_workers), self._registered, self._output_dir
            )
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
