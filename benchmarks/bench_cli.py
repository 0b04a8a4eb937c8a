"""CLI start-up: `hybridflow --help`, `--version` and `train --help` against the eager imports the CLI
used to make before it answered (hybridflow.trainers.base: torch, Ray, transformers).

Each command runs as a fresh process `--repeats` times; the table gives the median wall seconds, the
median CPU seconds of the process (user + system; steadier than wall time on a shared machine) and
the ratio to the baseline's median. Writes docs/bench/cli.md with --write.

    python benchmarks/bench_cli.py [--repeats 5] [--write]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("baseline: import hybridflow.trainers.base", ["-c", "import hybridflow.trainers.base"]),
    ("hybridflow --help", ["-m", "hybridflow.cli", "--help"]),
    ("hybridflow --version", ["-m", "hybridflow.cli", "--version"]),
    ("hybridflow train --help", ["-m", "hybridflow.cli", "train", "--help"]),
    ("hybridflow config --help", ["-m", "hybridflow.cli", "config", "--help"]),
]


def run_once(args: list[str]) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write", action="store_true", help="write docs/bench/cli.md")
    args = parser.parse_args()
    results = {}
    for _ in range(args.repeats):  # interleaved, so load changes hit every case alike
        for name, cmd in CASES:
            results.setdefault(name, []).append(run_once(cmd))
    base_wall = statistics.median(w for w, _ in results[CASES[0][0]])
    base_cpu = statistics.median(c for _, c in results[CASES[0][0]])
    lines = [
        "| command | wall s (median) | CPU s (median) | wall vs baseline | CPU vs baseline |",
        "|---|---|---|---|---|",
    ]
    for name, _ in CASES:
        wall = statistics.median(w for w, _ in results[name])
        cpu = statistics.median(c for _, c in results[name])
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {wall / base_wall:.3f}x | {cpu / base_cpu:.3f}x |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        text = (
            "# CLI start-up\n\n"
            f"`python benchmarks/bench_cli.py --repeats {args.repeats} --write`: each command as a fresh process, "
            "interleaved; the baseline is the import the CLI made before answering `--help` until lazy "
            "exports (hybridflow/_lazy.py). One run on the development machine (2 cores) while other jobs "
            "shared it: wall times are noisy, CPU seconds steadier.\n\n" + table + "\n"
        )
        (ROOT / "docs" / "bench" / "cli.md").write_text(text)


if __name__ == "__main__":
    main()
