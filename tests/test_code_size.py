"""Small files, small functions: no file under hybridflow/ over MAX_FILE_LINES lines, no function or
method over MAX_FUNCTION_LINES (from its `def` line to its last line, decorators excluded).

ALLOWED names the few that are over today, each with its size now. It may only shrink: an entry that is
now within the limit fails too (delete it), and one that grew fails (split it instead), so the list
records exactly the debts that remain.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridflow"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80

# "path" (a file) or "path::qualname" (a function) -> its size in lines when it was allowed
ALLOWED: dict[str, int] = {}


def file_lines(source: str) -> int:
    return len(source.splitlines())


def function_sizes(source: str) -> dict[str, int]:
    """qualname ("Class.method", "outer.inner") -> lines from the `def` line to the last line."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if not isinstance(child, ast.ClassDef):
                    sizes[name] = (
                        child.end_lineno - child.lineno + 1
                    )  # lineno is the def's, not a decorator's
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return sizes


def measure(package: Path, root: Path) -> dict[str, int]:
    """Every file over MAX_FILE_LINES and every function over MAX_FUNCTION_LINES -> its size."""
    over: dict[str, int] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        source = path.read_text()
        if (n := file_lines(source)) > MAX_FILE_LINES:
            over[rel] = n
        for name, n in function_sizes(source).items():
            if n > MAX_FUNCTION_LINES:
                over[f"{rel}::{name}"] = n
    return over


def size_problems(over: dict[str, int], allowed: dict[str, int]) -> list[str]:
    """One line per breach of the limits or of the allowlist's only-shrinks rule."""
    problems = []
    for key, n in sorted(over.items()):
        limit = MAX_FUNCTION_LINES if "::" in key else MAX_FILE_LINES
        if key not in allowed:
            problems.append(f"{key}: {n} lines, over the limit of {limit}; split it")
        elif n > allowed[key]:
            problems.append(f"{key}: {n} lines, grew past its allowed {allowed[key]}; split it")
        elif n < allowed[key]:
            problems.append(f"{key}: {n} lines, shrank from {allowed[key]}; lower its ALLOWED entry to {n}")
    for key in sorted(allowed.keys() - over.keys()):
        problems.append(f"{key}: now within the limit (or gone); delete its ALLOWED entry")
    return problems


def test_package_files_and_functions_are_within_the_limits():
    problems = size_problems(measure(PACKAGE, ROOT), ALLOWED)
    assert not problems, "\n".join(problems)


def test_the_allowlist_stays_short():
    assert len(ALLOWED) <= 10, "split code instead of allowing it"


def test_function_sizes_count_from_def_to_last_line_without_decorators():
    source = (
        "@decorator\n"  # 1: not counted
        "def f(x):\n"  # 2
        "    def inner():\n"  # 3
        "        return 1\n"  # 4
        "    return inner\n"  # 5
        "\n"
        "class C:\n"
        "    @property\n"
        "    def m(self):\n"  # 9
        "        '''doc'''\n"
        "        return (\n"
        "            1\n"
        "        )\n"  # 13
    )
    assert function_sizes(source) == {"f": 4, "f.inner": 2, "C.m": 5}
    assert file_lines(source) == 13


def test_the_rules_catch_new_grown_shrunk_and_stale_entries(tmp_path):
    pkg = tmp_path / "hybridflow"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def + 80 lines = 81
    (pkg / "big.py").write_text(f"def long():\n{body}\n")
    (pkg / "long_file.py").write_text("\n".join(f"y{i} = {i}" for i in range(MAX_FILE_LINES + 1)) + "\n")
    (pkg / "ok.py").write_text("def short():\n    return 1\n")
    over = measure(pkg, tmp_path)
    assert over == {"hybridflow/big.py::long": 81, "hybridflow/long_file.py": 501}
    assert size_problems(over, {"hybridflow/big.py::long": 81, "hybridflow/long_file.py": 501}) == []
    problems = size_problems(over, {"hybridflow/big.py::long": 90, "hybridflow/ok.py::short": 85})
    assert problems == [
        "hybridflow/big.py::long: 81 lines, shrank from 90; lower its ALLOWED entry to 81",
        "hybridflow/long_file.py: 501 lines, over the limit of 500; split it",
        "hybridflow/ok.py::short: now within the limit (or gone); delete its ALLOWED entry",
    ]
    assert size_problems(over, {"hybridflow/big.py::long": 80, "hybridflow/long_file.py": 501}) == [
        "hybridflow/big.py::long: 81 lines, grew past its allowed 80; split it"
    ]
