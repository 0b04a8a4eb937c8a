"""Helpers shared by the two sides of benchmarks/vs_trl.py."""

from __future__ import annotations

import psutil  # comes with accelerate (the `bench` extra)


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and every descendant alive now (Ray's GCS, raylet
    and worker processes are descendants of the driver that started the local cluster). Under a
    loaded machine this moves far less than wall time, so the table reports both."""
    procs = [psutil.Process()]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:  # exited between listing and reading
            continue
        total += t.user + t.system
    return total
