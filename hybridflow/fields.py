"""Dataclass fields that carry their help text: the one helper every config dataclass uses.

Each component's config dataclass lives with the component (engines/config.py: ParallelConfig,
OptimConfig; config/schema.py: the rest) and declares its fields with `setting` / `section`; the
config tree (config/schema.py) composes them, and `hybridflow config --help` / `config show --comments`
print the metadata. No imports beyond the standard library, so every module may use it.
"""

from __future__ import annotations

import math
from dataclasses import field


def setting(default, help: str, choices: tuple | None = None, derived: bool = False):
    """A field with its help string; `choices`: the allowed values (checked by validate_config);
    `derived`: filled in by resolve_config (a user value must agree with it)."""
    meta: dict = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if derived:
        meta["derived"] = True
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, help: str, **kwargs):
    """A nested component config, built with `kwargs` overriding its own defaults."""
    return field(default_factory=lambda: cls(**kwargs), metadata={"help": help})


def at_least(minimum, values: dict) -> list[str]:
    """'key: must be >= minimum, got v' for each value (key -> value) below `minimum`: the size checks
    each section's validator runs."""
    return [
        f"{key}: must be >= {minimum}, got {v}" for key, v in values.items() if not v >= minimum
    ]  # nan too


def finite_at_least(minimum, values: dict) -> list[str]:
    """As at_least, for values that must also be finite (a learning rate, a temperature)."""
    return [
        f"{key}: must be a finite number >= {minimum}, got {v}"
        for key, v in values.items()
        if not (math.isfinite(v) and v >= minimum)
    ]
