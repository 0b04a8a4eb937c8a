"""Helpers shared by the two sides of benchmarks/vs_trl.py."""

from __future__ import annotations

import argparse

import psutil  # comes with accelerate (the `bench` extra)


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The workload arguments both sides take (vs_trl.py passes the same values to each)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="HF model directory (saved by save_tiny_model)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="responses per prompt")
    p.add_argument("--response-length", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: TRL bf16=True (its GRPOConfig default: autocast), hybridflow model.dtype=bfloat16",
    )
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="responses end at EOS (learning row) instead of fixed length",
    )
    return p


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process and every descendant alive now (Ray's GCS, raylet
    and worker processes are descendants of the driver that started the local cluster); with `pid`,
    that process's tree instead (a `hybridflow train` subprocess; 0 once it has exited). Under a
    loaded machine this moves far less than wall time, so the table reports both."""
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:  # the process (pid) has exited
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited between listing and reading
            continue
        total += t.user + t.system
    return total
