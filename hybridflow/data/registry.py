"""Registered datasets: names like `synthetic:arithmetic` that build rows on the fly from a seed.

A registered dataset is a function `(split, seed, **kwargs) -> list[dict]` returning rows in the
same verl format the files hold, so it goes through the same parsing and tokenisation path.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable

from hybridflow.errors import DatasetError

_REGISTRY: dict[str, Callable[..., list[dict]]] = {}


def register_dataset(name: str):
    """Decorator: `@register_dataset("synthetic:arithmetic")`."""

    def deco(fn):
        _REGISTRY[name] = fn
        return fn

    return deco


def get_dataset(name: str) -> Callable[..., list[dict]]:
    import hybridflow.data.synthetic  # noqa: F401  (registers the built-in datasets)
    from hybridflow.data import reasoning_tasks

    if name.startswith(reasoning_tasks.PREFIX):  # one generator per task, named by reasoning-gym
        task = name.removeprefix(reasoning_tasks.PREFIX)
        reasoning_tasks.check_task(task)
        return functools.partial(reasoning_tasks.rows, task)
    if name not in _REGISTRY:
        near = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise DatasetError(
            f"data.dataset: unknown dataset {name!r}{hint}; registered: {sorted(_REGISTRY)} and "
            f"{reasoning_tasks.PREFIX}<task> (reasoning-gym's tasks)"
        )
    return _REGISTRY[name]


def build_rows(name: str, split: str, seed: int, kwargs: dict) -> list[dict]:
    """The rows of registered dataset `name`; keyword arguments it does not take are a DatasetError."""
    fn = get_dataset(name)
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = [k for k in params if k not in ("split", "seed")]
        unknown = [k for k in kwargs if k not in accepted]
        if unknown:
            near = difflib.get_close_matches(unknown[0], accepted, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise DatasetError(
                f"data.dataset_kwargs: {name!r} takes no argument {unknown[0]!r}{hint}; it takes {accepted}"
            )
    try:
        return fn(split=split, seed=seed, **kwargs)
    except (TypeError, ValueError) as e:  # a bad value in dataset_kwargs (e.g. num_samples: 'ten')
        raise DatasetError(f"data.dataset_kwargs: {name!r} with {kwargs} failed: {e}") from None


def list_datasets() -> list[str]:
    import hybridflow.data.synthetic  # noqa: F401

    return sorted(_REGISTRY)
