"""rollout/cpu/ (CPU-only decode tuning) stays a leaf: it imports nothing from the rest of hybridflow, so
the core can use it, or drop a piece of it, without an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

CPU = Path(__file__).resolve().parents[2] / "hybridflow" / "rollout" / "cpu"


def test_cpu_tuning_imports_nothing_from_hybridflow():
    found = []
    for path in sorted(CPU.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "hybridflow"]
    assert [p.name for p in CPU.glob("*.py")], "the package is where this test looks"
    assert not found, found
