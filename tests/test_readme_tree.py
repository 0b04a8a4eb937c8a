"""The README's annotated package tree stays true: every module and folder of the package is listed,
and every name listed exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tree_block() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- tree:start -->(.*)<!-- tree:end -->", text, re.S)
    assert m, "README.md lost its <!-- tree:start --> ... <!-- tree:end --> block"
    return m.group(1)


def _listed_names(block: str) -> set[str]:
    names = set()
    for line in block.splitlines():
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        names.update(n.strip() for n in head.split(",") if n.strip())
    return names


def test_every_package_module_is_in_the_readme_tree():
    listed = _listed_names(_tree_block())
    pkg = ROOT / "hybridflow"
    missing = []
    for path in sorted(pkg.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        if path.name not in listed:
            missing.append(str(path.relative_to(ROOT)))
    for d in sorted(p for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        if f"{d.name}/" not in listed:
            missing.append(f"{d.relative_to(ROOT)}/")
    assert not missing, f"add these to the README tree: {missing}"


def test_every_module_in_the_readme_tree_exists():
    pkg = ROOT / "hybridflow"
    existing = {p.name for p in pkg.rglob("*.py")}
    listed_py = {n for n in _listed_names(_tree_block()) if n.endswith(".py") and "/" not in n}
    stale = sorted(listed_py - existing - {"demo.py"})
    assert not stale, f"the README tree lists modules that do not exist: {stale}"
