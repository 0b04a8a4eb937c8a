"""A pool spanning two simulated nodes (ray.cluster_utils.Cluster), in a subprocess with its own Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pool_spans_two_nodes_with_ranks_ordered_by_node():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.controller.multinode_check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(lines[-1].removeprefix("RESULT "))
    nodes = r["pool_nodes"]
    assert len(r["cluster_nodes"]) == 2 and sorted(set(nodes)) == r["cluster_nodes"]  # spans both
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]  # ordered by node
    assert r["worker_nodes"] == nodes and r["ranks"] == [0, 1, 2, 3]  # each rank runs where it says
    assert r["y"] == [0.0, 2.0, 4.0, 6.0, 8.0] and r["world"] == [4] * 5  # one gloo group across nodes
