"""The one line `hybridflow train` prints at start when a faster setting fits the run's resources.

The planner (planner/, docs/planner.md) prices the run as configured and with each setting it could add:
one step ahead (`trainer.rollout_ahead=1`, generation on its own pool, the training one step off-policy)
and bf16 compute (`model.dtype=bfloat16`, fp32 master weights) on a CPU that multiplies in bf16 (AMX or
AVX512-BF16; elsewhere bf16 runs at a fraction of fp32's rate). Each variant is the user's config with the
setting added, validated as `hybridflow train` would; none that the config refuses is offered. Nothing
changes by itself: each trades something (a policy one step old, bf16 rounding), so the user decides.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.models.cpu import CpuInfo, this_cpu

MIN_GAIN = 1.1
"""The smallest predicted gain worth a line. The planner prices CPU steps coarsely (one catalogue entry
per dtype, docs/planner.md): its absolute seconds are not printed, and a gain under 10% is within what
it cannot tell apart."""

BF16_MIN_PARAMS = 5_000_000
"""Below this a model's GEMMs are too small for bf16 to pay on a CPU, whatever the planner's GEMM rate says:
the 0.8M benchmark model steps slower in bf16 than in fp32, the 25M one faster (docs/bench/vs_trl.md)."""

AHEAD, BF16 = "trainer.rollout_ahead=1", "model.dtype=bfloat16"
TRADE = {AHEAD: "trains on rollouts one step old", BF16: "computes in bf16 over fp32 master weights"}


def cpu_computes_bf16(cpu: CpuInfo | None = None) -> bool:
    """Whether this CPU (or `cpu`) multiplies bf16 natively: AMX-BF16 or AVX512-BF16 among its flags."""
    return bool((cpu or this_cpu()).flags & {"amx_bf16", "avx512_bf16"})


def predicted_seconds(cfg) -> float | None:
    """The planner's step time for `cfg`'s schedule (its best placement on the run's devices), or None
    where it has no prediction (an algorithm it cannot place, no placement that fits)."""
    from hybridflow.errors import UserError
    from hybridflow.trainers.auto_placement import plan_for_config

    try:
        plan = plan_for_config(cfg)
    except (UserError, ValueError, FileNotFoundError):
        return None
    return plan.iteration_seconds or None


def candidates(cfg) -> list[list[str]]:
    """The settings (override lists) worth pricing for `cfg`: those it does not have already."""
    from hybridflow.trainers.perf import count_params
    from hybridflow.workers.common import computes_in_fp32

    ahead = not getattr(cfg.trainer, "rollout_ahead", 1) and cfg.resources.num_devices >= 2
    bf16 = cfg.resources.device in ("cpu", "auto") and computes_in_fp32(cfg.model.dtype, cfg.resources.device)
    bf16 = bf16 and cpu_computes_bf16() and count_params(cfg.model.path) >= BF16_MIN_PARAMS
    out = [[AHEAD]] * ahead + [[BF16]] * bf16
    return out + ([[BF16, AHEAD]] if ahead and bf16 else [])


def faster_setting(cfg, load: Callable[[list[str]], object]) -> str | None:
    """The hint line, or None. load(extra overrides) -> the user's config with them added (validated:
    raises a UserError where the config refuses them)."""
    from hybridflow.errors import UserError

    options = candidates(cfg)
    now = predicted_seconds(cfg) if options else None
    if now is None:
        return None
    best, best_s = None, now
    for extra in options:
        try:
            seconds = predicted_seconds(load(extra))
        except UserError:
            continue
        if seconds is not None and seconds < best_s:
            best, best_s = extra, seconds
    if best is None or now / best_s < MIN_GAIN:
        return None
    trade = "; ".join(TRADE[s] for s in best)
    return (
        f"hint: {' '.join(best)} is predicted {now / best_s:.2f}x faster on these {cfg.resources.num_devices} "
        f"device(s) (the planner's estimate of the step time; it {trade})"
    )
