"""Every config field is read or rejected (issue: "a setting accepted then ignored is a defect").

A static walk, like tests/test_readme_tree.py: for each leaf field of the schema, something in the
package outside the config machinery must read it, or validation must reject its values.

What counts as a read: an attribute load `.name` (or `getattr(x, "name")`) whose base is known to
be the field's section, because
  - the base's attribute chain ends with the section's field name (`cfg.rollout.n`, `a.kl.coef`
    after `a = cfg.algorithm`, `self.cfg = cfg` followed by `self.cfg.trainer.seed`), or
  - the base is typed as the section's dataclass: a parameter annotated with it (`cfg: OptimConfig`,
    unions too) or a name assigned from its constructor (`cfg = RewardConfig(...)`).
Aliases are tracked per module, flow-insensitively: generous, but never by field name alone, so a
`.tg` of an unrelated object does not count as reading `rollout.tg`.

Not counted: config/schema.py, config/algorithm_config.py, engines/config.py (they define the fields),
the loader and the CLI (they handle every field alike), the checks of validate.py and model_checks.py, and
config/roles.py, which copies fields into the role workers' configs: a worker's read of its copy
(`self.config.seed`, typed ActorWorkerConfig) counts for the field copied (`trainer.seed`).
resolve_config and its helpers count: deriving values from a field acts on it (filling in a field's own
default, `if x.f == 0: x.f = ...`, does not), and so do the config classes' own properties.

When you add a field: read it where it takes effect. If it is not implemented yet, list it in
config/validate.py NOT_YET (rejected in one line, checked below) or in CHECKED_ONLY here with the
overrides validation must reject; remove the entry when the feature lands.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest

from hybridflow.config import ConfigError, HybridFlowConfig, collect_errors, load_config
from hybridflow.config.validate import NOT_YET

PACKAGE = Path(__file__).resolve().parents[2] / "hybridflow"
SKIP = {"engines/config.py", "fields.py", "config/loader.py", "config/cli.py", "config/algorithm_config.py",
        "config/model_checks.py", "config/roles.py"}  # fmt: skip
# Modules where only some top-level functions or classes count: validate.py's derivations (the rest
# only checks values), and the config classes' properties (ResourcesConfig.num_devices, run_dir); their field
# definitions and each section's checks are not reads.
ONLY = {
    "config/validate.py": {"resolve_config", "section_devices", "split_sizes", "_dp"},
    "config/schema.py": {"HybridFlowConfig"},
    "config/run_config.py": {"ResourcesConfig"},
}
BASE = ["model.path=m", "data.dataset=synthetic:arithmetic"]

# Fields whose only use is a check: key -> overrides (on BASE) that validation must reject, each
# with an error line starting with the key.
CHECKED_ONLY = {
    # each algorithm has its own estimator; the field exists for verl-style configs
    "algorithm.adv_estimator": [["algorithm.adv_estimator=grpo"]],
    # generation pipeline parallelism does not exist; hybrid_engine/layout.py rejects pg != 1
    "rollout.pg": [["rollout.pg=2"]],
}


def schema_fields(cls=HybridFlowConfig, prefix: str = "") -> list[tuple[str, type, str, str]]:
    """(dotted path, owning dataclass, name of the section field holding it, field name) per leaf."""
    out = []
    hints = typing.get_type_hints(cls)
    section = prefix.rstrip(".").rpartition(".")[2]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, cls, section, f.name))
    return out


def _chain(node) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _type_names(annotation) -> set[str]:
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(annotation) if isinstance(n, ast.Attribute)
    }


class _Reads(ast.NodeVisitor):
    """Collects aliases (name -> chains / class names) and attribute loads (base, attr) of a module."""

    def __init__(self):
        self.aliases: dict[str, set[str]] = {}  # 'm' -> {'self.config.model'}; 'cfg' -> {'<OptimConfig>'}
        self.loads: list[tuple[str | None, str]] = []

    def _alias(self, target, value) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                self._alias(t, v)
            return
        name = _chain(target)
        if name is None:
            return
        for v in value.values if isinstance(value, ast.BoolOp) else [value]:  # `config or RewardConfig()`
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id[:1].isupper():
                self.aliases.setdefault(name, set()).add(f"<{v.func.id}>")
            elif isinstance(v, ast.Call) and _chain(v.func) == "getattr" and len(v.args) >= 2:
                base, attr = _chain(v.args[0]), v.args[1]
                if base and isinstance(attr, ast.Constant):
                    self.aliases.setdefault(name, set()).add(f"{base}.{attr.value}")
            elif _chain(v) is not None:
                self.aliases.setdefault(name, set()).add(_chain(v))

    def visit_Assign(self, node):
        for t in node.targets:
            self._alias(t, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self._alias(node.target, node.value)
        self.generic_visit(node)

    def _args(self, node):
        for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            for t in _type_names(a.annotation):
                self.aliases.setdefault(a.arg, set()).add(f"<{t}>")
        self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _args

    def visit_ClassDef(self, node):
        self.aliases.setdefault("self", set()).add(f"<{node.name}>")  # methods read their own fields
        self.generic_visit(node)

    def visit_If(self, node):
        """`if x.f == 0: x.f = ...` fills a default: that test is not a read of x.f."""
        stored = {
            _chain(n)
            for b in node.body
            for n in ast.walk(b)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        }
        for n in ast.walk(node.test):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and _chain(n) not in stored:
                self.loads.append((_chain(n.value), n.attr))
        for child in [*node.body, *node.orelse]:
            self.visit(child)

    def visit_Attribute(self, node):
        if isinstance(node.ctx, ast.Load):
            self.loads.append((_chain(node.value), node.attr))
        self.generic_visit(node)

    def visit_Call(self, node):
        if _chain(node.func) == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            self.loads.append((_chain(node.args[0]), str(node.args[1].value)))
        self.generic_visit(node)


def _resolve(chain: str, aliases: dict[str, set[str]], depth: int = 0) -> set[str]:
    """Every expansion of `chain` through the aliases of its longest aliased prefix."""
    out = {chain}
    if depth > 4:
        return out
    parts = chain.split(".")
    for k in range(len(parts), 0, -1):
        head = ".".join(parts[:k])
        if head in aliases:
            for a in aliases[head]:
                out |= (
                    _resolve(".".join([a, *parts[k:]]), aliases, depth + 1) if not a.startswith("<") else {a}
                )
            break
    return out


def package_reads() -> set[tuple[str, str]]:
    """{(section field name or '<ClassName>', attribute)} loaded anywhere that counts."""
    reads = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in SKIP:
            continue
        tree = ast.parse(path.read_text())
        if rel in ONLY:
            tree = ast.Module([n for n in tree.body if getattr(n, "name", None) in ONLY[rel]], [])
        v = _Reads()
        v.visit(tree)
        for base, attr in v.loads:
            for b in _resolve(base, v.aliases) if base else ():
                reads.add((b if b.startswith("<") else b.rpartition(".")[2], attr))
    return reads


def role_copies() -> dict[str, set[tuple[str, str]]]:
    """Tree fields config/roles.py copies into a worker config's own field (`seed=cfg.trainer.seed`):
    dotted path -> {('<ActorWorkerConfig>', 'seed'), ...}. Copying is not acting; the worker's read is."""
    out: dict[str, set[tuple[str, str]]] = {}
    for node in ast.walk(ast.parse((PACKAGE / "config" / "roles.py").read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            for kw in node.keywords:
                chain = _chain(kw.value)
                if chain and chain.count(".") >= 2:  # a field (cfg.trainer.seed), not a section
                    out.setdefault(chain.removeprefix("cfg."), set()).add((f"<{node.func.id}>", kw.arg))
    return out


def unread_fields() -> list[str]:
    reads = package_reads()
    for path, copies in role_copies().items():  # a worker reading its copy reads the tree's field
        if copies & reads:
            reads.add((path.split(".")[-2], path.split(".")[-1]))
    exempt = set(NOT_YET) | set(CHECKED_ONLY)
    return [
        path
        for path, cls, section, name in schema_fields()
        if path not in exempt and (section, name) not in reads and (f"<{cls.__name__}>", name) not in reads
    ]


def test_every_field_is_read_somewhere():
    assert unread_fields() == []


def test_the_walk_finds_reads_and_misses():
    """The static walk itself: a read through an alias and a typed parameter count; the same name on
    an unrelated object does not."""
    v = _Reads()
    v.visit(ast.parse("def f(cfg, o: OptimConfig, m):\n    r = cfg.rollout\n    r.n\n    o.lr\n    m.tg\n"))
    reads = {
        (b if b.startswith("<") else b.rpartition(".")[2], a)
        for base, a in v.loads
        for b in _resolve(base, v.aliases)
    }
    assert {("rollout", "n"), ("<OptimConfig>", "lr")} <= reads and ("rollout", "tg") not in reads


@pytest.mark.parametrize("key", sorted(NOT_YET))
def test_not_yet_implemented_values_are_rejected_in_one_line(key):
    works, _ = NOT_YET[key]
    default = load_config(None, BASE, check_model=False)
    node = default
    for part in key.split("."):
        node = getattr(node, part)
    assert node in works  # the default works
    f = next(
        f
        for path, cls, _, name in schema_fields()
        if path == key
        for f in dataclasses.fields(cls)
        if f.name == name
    )
    bad = (
        next(c for c in f.metadata["choices"] if c not in works) if "choices" in f.metadata else works[0] + 1
    )
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, f"{key}={bad}"], check_model=False)
    lines = [line for line in e.value.errors if line.startswith(f"{key}: ") and "not supported yet" in line]
    assert len(lines) == 1 and all("\n" not in line for line in e.value.errors), e.value.errors


@pytest.mark.parametrize("key", sorted(CHECKED_ONLY))
def test_checked_only_fields_are_rejected(key):
    for overrides in CHECKED_ONLY[key]:
        cfg = load_config(None, [*BASE, *overrides], validate=False)
        assert [e for e in collect_errors(cfg, check_model=False) if e.startswith(key)], overrides


def test_every_worker_config_field_is_read_by_its_worker():
    """What config/roles.py sends a worker, the worker reads: a field nothing reads is one it was sent and
    ignores. A read: `self.config.x` in a worker whose `config` parameter is typed with the class, or
    `config.x` where the class cannot be named (rollout/factory.py, a layer below config/)."""
    from hybridflow.config.roles import ActorWorkerConfig, CriticWorkerConfig, RewardWorkerConfig

    reads = package_reads()
    unread = [
        f"{cls.__name__}.{f.name}"
        for cls in (ActorWorkerConfig, CriticWorkerConfig, RewardWorkerConfig)
        for f in dataclasses.fields(cls)
        if (f"<{cls.__name__}>", f.name) not in reads and ("config", f.name) not in reads
    ]
    assert unread == []
