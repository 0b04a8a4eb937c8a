"""`make bench`: run every benchmarks/bench_*.py, the chaos runs (chaos.py), then the end-to-end comparison
with TRL (vs_trl.py).
Each prints its own table; the latest tables are kept in docs/benchmarks.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
failed = []
for script in [*sorted(here.glob("bench_*.py")), here / "chaos.py", here / "vs_trl.py"]:
    print(f"\n=== {script.name} ===", flush=True)
    if subprocess.call([sys.executable, str(script)]) != 0:
        failed.append(script.name)
if failed:
    sys.exit(f"benchmarks failed: {failed}")
