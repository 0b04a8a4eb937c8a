"""Registered datasets: names like `synthetic:arithmetic` that build rows on the fly from a seed.

A registered dataset is a function `(split, seed, **kwargs) -> list[dict]` returning rows in the
same verl format the files hold, so it goes through the same parsing and tokenisation path.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

_REGISTRY: dict[str, Callable[..., list[dict]]] = {}


def register_dataset(name: str):
    """Decorator: `@register_dataset("synthetic:arithmetic")`."""

    def deco(fn):
        _REGISTRY[name] = fn
        return fn

    return deco


def get_dataset(name: str) -> Callable[..., list[dict]]:
    import hybridflow.data.synthetic  # noqa: F401  (registers the built-in datasets)

    if name not in _REGISTRY:
        near = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise KeyError(f"unknown dataset {name!r}{hint}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def list_datasets() -> list[str]:
    import hybridflow.data.synthetic  # noqa: F401

    return sorted(_REGISTRY)
