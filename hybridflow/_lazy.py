"""Lazy package exports (PEP 562): `from hybridflow.trainers import build_trainer` imports the heavy
submodule (torch, Ray) only when the name is first used, so `hybridflow COMMAND --help` stays instant."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, names: dict[str, str]):
    """A module `__getattr__` that resolves each name from its submodule (name -> submodule)."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{names[name]}"), name)

    return __getattr__
