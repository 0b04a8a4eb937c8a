"""This machine's limits, measured, and each phase of a run against them (benchmarks/vs_trl.py's limit table).

- GEMM peak: the best FLOP/s of a square matmul (2 n^3 FLOPs) per dtype and thread count, the ceiling of
  the training and log-prob phases, whose work is GEMMs of the model's weights (2 N FLOPs per token
  forward, 6 N forward + backward: trainers/perf.py). In fp32 the faster of PyTorch's matmul (MKL) and
  oneDNN's (models/cpu_gemm.py, which the engines use where it is faster): on some CPUs they differ 2x.
- Memory bandwidth: bytes/s of a large copy (read + write), the floor of decode: every decode step reads
  the whole generation weights once, so a step of a batch small enough to be bandwidth-bound takes at
  least weight bytes / bandwidth.

A phase's achieved FLOP/s comes from the run's own metrics (perf/tflops_per_device/<phase>: its FLOPs
over its busy seconds per device); a device here is one worker process with its threads, so it is held
against the peak measured at that thread count.
"""

from __future__ import annotations

import statistics
import time

import torch

from hybridflow.models import cpu_gemm

GEMM_N = 1024  # square matmul side: big enough to reach MKL / oneDNN's rate, small enough to time in ms
COPY_BYTES = 256 * 2**20  # far larger than the last-level cache


def _best_rate(fn, work: float, seconds: float) -> float:
    """work / the fastest call of fn over ~`seconds` (after one warm-up call)."""
    fn()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return work / best


def gemm_peak(dtype: torch.dtype, threads: int, n: int = GEMM_N, seconds: float = 1.0) -> float:
    """Peak FLOP/s of an n x n @ n x n matmul in `dtype` on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        rate = _best_rate(lambda: torch.mm(a, b, out=out), 2.0 * n**3, seconds)
        if dtype == torch.float32 and cpu_gemm.available():
            rate = max(rate, _best_rate(lambda: cpu_gemm.matmul(a, b), 2.0 * n**3, seconds))
        return rate
    finally:
        torch.set_num_threads(before)


def memory_bandwidth(threads: int, nbytes: int = COPY_BYTES, seconds: float = 1.0) -> float:
    """Bytes/s of a copy of `nbytes` (read + write counted) on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        return _best_rate(lambda: dst.copy_(src), 2.0 * nbytes, seconds)
    finally:
        torch.set_num_threads(before)


def measure(threads: tuple[int, ...] = (1, 2)) -> dict:
    """{"gemm": {threads: {"fp32"|"bf16": FLOP/s}}, "bandwidth": {threads: bytes/s}}."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    return {
        "gemm": {t: {k: gemm_peak(d, t) for k, d in dtypes.items()} for t in threads},
        "bandwidth": {t: memory_bandwidth(t) for t in threads},
    }


# table column -> the run's perf/ phase names (their FLOPs over their busy seconds)
LIMIT_PHASES = {"update": "update_actor", "ref": "ref", "old": "old_log_prob"}


def phase_rates(steps: list[dict]) -> dict[str, float]:
    """Median achieved FLOP/s per device of each compute phase over the measured steps (a step holds the
    run's perf/* metrics under "perf"); phases the run did not time are left out."""
    out = {}
    for col, phase in LIMIT_PHASES.items():
        key = f"perf/tflops_per_device/{phase}"
        vals = [s["perf"][key] * 1e12 for s in steps if key in s.get("perf", {})]
        if vals:
            out[col] = statistics.median(vals)
    return out


def decode_floor_seconds(steps: list[dict], weight_bytes: float, bandwidth: float) -> float:
    """Median over steps of the decode floor: longest response (decode steps) x generation weight bytes /
    bandwidth. A replica's rows decode together, so each step reads the weights once."""
    return statistics.median(s.get("response_max", 0.0) * weight_bytes / bandwidth for s in steps)


def limits_row(label: str, steps: list[dict], peak: float, weight_bytes: float, bandwidth: float) -> str:
    """One line of the limit table: each compute phase's GFLOP/s and % of the GEMM peak, then generation
    seconds against the decode floor."""
    rates = phase_rates(steps)
    cells = []
    for col in LIMIT_PHASES:
        r = rates.get(col)
        cells.append("-" if r is None else f"{r / 1e9:.0f} ({100 * r / peak:.0f}%)")
    gen = statistics.median(s["generation"] for s in steps)
    floor = decode_floor_seconds(steps, weight_bytes, bandwidth)
    return (
        f"| {label} | {peak / 1e9:.0f} | " + " | ".join(cells) + f" | {gen:.2f} / {floor:.2f} "
        f"({floor / gen:.0%} of the floor's speed) |\n"
        if gen > 0
        else f"| {label} | {peak / 1e9:.0f} | " + " | ".join(cells) + " | - |\n"
    )


LIMITS_HEAD = (
    "| run | GEMM peak GFLOP/s (dtype, threads per worker) | update GFLOP/s (% of peak) | ref GFLOP/s (%) | "
    "old log-probs GFLOP/s (%) | generation s / decode floor s |\n" + "|---" * 6 + "|\n"
)


def peaks_table(limits: dict) -> str:
    """The measured limits as a table."""
    out = "| threads | fp32 GEMM GFLOP/s | bf16 GEMM GFLOP/s | bf16 / fp32 | copy bandwidth GB/s |\n|---|---|---|---|---|\n"
    for t, g in limits["gemm"].items():
        out += (
            f"| {t} | {g['fp32'] / 1e9:.0f} | {g['bf16'] / 1e9:.0f} | {g['bf16'] / g['fp32']:.1f}x | "
            f"{limits['bandwidth'][t] / 1e9:.1f} |\n"
        )
    return out


if __name__ == "__main__":
    print(peaks_table(measure()))
