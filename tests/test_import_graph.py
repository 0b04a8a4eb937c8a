"""The package import graph follows docs/design.md's layering (§7, "Layers"): no circles between packages.

A static walk, like tests/test_readme_tree.py: every `import` / `from ... import` in every module of
hybridflow/ (function-level and TYPE_CHECKING imports too: a lazy import is still a dependency), mapped to
the unit it lands in: a subpackage (`config`, `workers`, ...) or a top-level module (`batch`, `errors`).
The layers come from the design doc's block, so the doc and the check cannot drift apart. A failure names
the edge and the file:line that makes it.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridflow"
DESIGN = ROOT / "docs" / "design.md"
# The planner is pure (docs/planner.md): besides itself, only these modules, which import nothing but the
# standard library. calibrate.py is the `hybridflow calibrate` command, which times real models on this
# machine beside the planner's predictions, and microbench.py / microbench_path.py its micro-benchmarks (the
# latter on the worker path: a worker group, a parallelized model, the training engine, the 3D-HybridEngine's
# switch); no other planner module imports them.
PLANNER_MAY_IMPORT = {
    "hybridflow.hybrid_engine.cost",
    "hybridflow.hybrid_engine.sync_budget",
    "hybridflow.errors",
}
PLANNER_MEASURES = {
    "hybridflow.planner.calibrate": {
        "hybridflow.models.tiny",
        "hybridflow.models.cpu_gemm",
        "hybridflow.models.cpu",
    },
    "hybridflow.planner.microbench": {
        "hybridflow.models.tiny",
        "hybridflow.models.cpu_gemm",
        "hybridflow.batch",
        "hybridflow.rollout.base",  # the responses' text, decoded as a rollout rank does
        "hybridflow.rollout.engine",  # a decode step timed on the engine runs generate with
    },
    "hybridflow.planner.microbench_path": {
        "hybridflow.models.tiny",
        "hybridflow.engines.parallelize",
        "hybridflow.engines.config",
        "hybridflow.engines.optim",
        "hybridflow.engines.train_engine",
        "hybridflow.hybrid_engine.resharder",
        "hybridflow.hybrid_engine.pipeline_switch",
        "hybridflow.controller",
        "hybridflow.controller.timers",  # the empty step is timed through the trainer's own timers
        "hybridflow.controller.resource_pool",  # its processes start with the workers' environment
        "hybridflow.controller.process",  # the cores a CPU rank's threads are counted from
        "hybridflow.batch",
    },
}


def layers() -> list[list[str]]:
    """The units of each layer, top layer first, from the ```layers block of docs/design.md."""
    block = re.search(r"```layers\n(.*?)```", DESIGN.read_text(), re.S)
    assert block, "docs/design.md lost its ```layers block"
    return [line.split("#")[0].split() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def units() -> set[str]:
    return {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()} - {
        "__init__"
    }


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every hybridflow import in `path`, relative ones resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # `from hybridflow import batch` imports the module hybridflow.batch (`__version__`: the root)
            sub = units() if base == "hybridflow" else set()
            out += [(f"{base}.{a.name}" if a.name in sub else base, node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m == "hybridflow" or m.startswith("hybridflow.")]


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "hybridflow"


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> ['hybridflow/x/y.py:12 imports hybridflow.z', ...]."""
    out = defaultdict(list)
    for path in sorted(PACKAGE.rglob("*.py")):
        src = unit_of(module_name(path))
        for module, line in imports(path):
            dst = unit_of(module)
            if dst != src:
                out[(src, dst)].append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one unit (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_layers_name_every_unit_once():
    named = [u for layer in layers() for u in layer]
    assert len(named) == len(set(named)), f"a unit is in two layers: {named}"
    present = units() | {"hybridflow"}
    assert set(named) == present, (
        f"docs/design.md's layers miss {sorted(present - set(named))} "
        f"or name what does not exist: {sorted(set(named) - present)}"
    )


def test_no_package_level_cycle():
    graph = defaultdict(set)
    for src, dst in edges():
        graph[src].add(dst)
    found = cycles(graph)
    where = {" -> ".join(c): [e[0] for (s, d), e in edges().items() if s in c and d in c] for c in found}
    assert not found, f"import circles between packages: {where}"


def test_imports_only_go_down_the_layers():
    level = {u: -i for i, layer in enumerate(layers()) for u in layer}  # the top layer is the highest
    bad = [
        f"{src} -> {dst} ({', '.join(where[:3])})"
        for (src, dst), where in sorted(edges().items())
        if level.get(dst, 1) >= level.get(src, 0)
    ]
    assert not bad, "imports against docs/design.md's layers:\n" + "\n".join(bad)


def test_planner_is_pure():
    bad = []
    for path in sorted((PACKAGE / "planner").rglob("*.py")):
        name = module_name(path)
        allowed = PLANNER_MAY_IMPORT | PLANNER_MEASURES.get(name, set())
        for module, line in imports(path):
            if module.startswith("hybridflow.planner") or module in allowed:
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "the planner imports beyond its pure modules:\n" + "\n".join(bad)
    for path in PACKAGE.rglob("*.py"):
        if module_name(path) not in PLANNER_MEASURES:
            assert not any(m in PLANNER_MEASURES for m, _ in imports(path)), path


def test_the_planners_imports_are_pure():
    """The modules the planner may import import nothing from the package themselves."""
    for module in PLANNER_MAY_IMPORT:
        path = ROOT / (module.replace(".", "/") + ".py")
        assert imports(path) == [], f"{module} imports {imports(path)}"


def test_the_walk_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: a lazy import inside a function and a relative import both count."""
    pkg = tmp_path / "hybridflow" / "planner"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    mod = pkg / "x.py"
    mod.write_text("def f():\n    from hybridflow.workers import actor\n\nfrom ..trainers import base\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(imports(mod)) == [("hybridflow.trainers", 4), ("hybridflow.workers", 2)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_importing_the_planner_loads_no_torch():
    """What the static walk promises, checked at run time: every planner module but calibrate imports
    without torch, Ray or another layer's package."""
    import subprocess

    modules = sorted(
        module_name(p) for p in (PACKAGE / "planner").rglob("*.py") if module_name(p) not in PLANNER_MEASURES
    )
    code = (
        f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
        "print(sorted({m.split('.')[0] if not m.startswith('hybridflow.') else '.'.join(m.split('.')[:2])"
        " for m in sys.modules}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(eval(out))
    assert not loaded & {"torch", "ray", "transformers"}, loaded
    assert {m for m in loaded if m.startswith("hybridflow.")} <= {
        "hybridflow.planner",
        "hybridflow.hybrid_engine",
    }
