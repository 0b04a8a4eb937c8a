"""Dataclass fields that carry their help text and their domain: the one helper every config dataclass uses.

Each component's config dataclass lives with the component (engines/config.py: ParallelConfig,
OptimConfig; config/schema.py: the rest) and declares its fields with `setting` / `section`; the
config tree (config/schema.py) composes them, and `hybridflow config --help` / `config show --comments`
print the metadata. Every numeric setting declares its domain there (bounds; floats are finite unless
a field says otherwise) and `domain_errors` checks the whole tree against them in one walk, so no
section can forget a range (config/validate.py runs it before any other check). No imports beyond the
standard library, so every module may use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field

# Waits longer than this overflow the OS timers (threading and queue waits raise OverflowError past
# ~9.2e9 s); 1e9 s is some 31 years, so the cap only refuses values that are not durations at all.
MAX_SECONDS = 1e9
# Seeds go to torch, numpy and vLLM, whose narrowest (vLLM's per-request seed) is a signed 32-bit int.
MAX_SEED = 2**31 - 1
# Sizes in MiB become byte limits of setrlimit, a signed 64-bit number (2**63 bytes = 2**43 MiB).
MAX_MB = 2**42
# Counts of machines, or of processes or threads on one (far above any cluster or machine): a larger value
# is not a count at all, and would overflow the C int of torch.set_num_threads or start processes without end.
MAX_PER_MACHINE = 2**16


@dataclass(frozen=True)
class Domain:
    """The numbers a setting admits: a lower bound (ge or gt), an upper one (le or lt); floats must be
    finite unless `finite` is False (then +-inf pass where the bounds do; NaN never does)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = True

    def admits(self, v) -> bool:
        if isinstance(v, float) and (math.isnan(v) or (self.finite and math.isinf(v))):
            return False  # (an int is finite, and may be too large for math's float conversion)
        return not (
            (self.ge is not None and v < self.ge)
            or (self.gt is not None and v <= self.gt)
            or (self.le is not None and v > self.le)
            or (self.lt is not None and v >= self.lt)
        )

    def describe(self, is_float: bool) -> str:
        """'>= 1', 'in (0, 1]', 'a finite number >= 0', ...: what the domain admits, for a message."""
        ge, gt, le, lt = (_num(b) for b in (self.ge, self.gt, self.le, self.lt))
        low = f"[{ge}" if ge is not None else f"({gt}" if gt is not None else None
        high = f"{le}]" if le is not None else f"{lt})" if lt is not None else None
        if low and high:
            return f"in {low}, {high}"  # a closed-in interval says finite already
        bound = (
            f">= {ge}" if ge is not None else f"> {gt}" if gt is not None
            else f"<= {le}" if le is not None else f"< {lt}" if lt is not None else ""
        )  # fmt: skip
        if is_float and self.finite:
            return f"a finite number {bound}".strip()
        return bound or "a number (not NaN)"


def _num(bound) -> str | None:
    """A bound as a message shows it: 1e9 as 1000000000, 0.5 as 0.5."""
    if isinstance(bound, float) and bound.is_integer():
        return str(int(bound))
    return None if bound is None else str(bound)


def setting(
    default,
    help: str,
    choices: tuple | None = None,
    derived: bool = False,
    *,
    ge=None,
    gt=None,
    le=None,
    lt=None,
    unit: bool = False,
    finite: bool = True,
):
    """A field with its help string and its domain.

    choices: the allowed values. ge / gt / le / lt: bounds of a number (of each item of a list of
    numbers); unit: in [0, 1]. A float field is a finite number even without bounds (finite=False
    admits +-inf). derived: filled in by resolve_config (a user value must agree with it). All are
    checked by `domain_errors` (config/validate.py runs it before any other check)."""
    meta: dict = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if derived:
        meta["derived"] = True
    if unit:
        ge, le = 0, 1
    numeric = _is_number(default) or (isinstance(default, list) and default and all(map(_is_number, default)))
    if choices is None and (numeric or any(b is not None for b in (ge, gt, le, lt))):
        meta["domain"] = Domain(ge=ge, gt=gt, le=le, lt=lt, finite=finite)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, help: str, **kwargs):
    """A nested component config, built with `kwargs` overriding its own defaults."""
    return field(default_factory=lambda: cls(**kwargs), metadata={"help": help})


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def domain_errors(obj, prefix: str = "") -> list[str]:
    """One line per setting of the config dataclass `obj` (recursing into nested configs and lists of
    them) outside its declared domain or choices: 'key: must be <domain>, got <value>'."""
    errors: list[str] = []
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            errors += domain_errors(value, path + ".")
        elif isinstance(value, list) and any(dataclasses.is_dataclass(v) for v in value):
            for i, item in enumerate(value):
                errors += domain_errors(item, f"{path}[{i}].") if dataclasses.is_dataclass(item) else []
        elif "choices" in f.metadata:
            errors += _choice_error(path, value, f.metadata["choices"])
        elif "domain" in f.metadata:
            items = enumerate(value) if isinstance(value, list) else [(None, value)]
            for i, v in items:
                errors += _number_error(path if i is None else f"{path}[{i}]", v, f.metadata["domain"])
    return errors


def _number_error(path: str, v, domain: Domain) -> list[str]:
    if not _is_number(v):
        return [f"{path}: must be a number, got {v!r}"]
    if domain.admits(v):
        return []
    return [f"{path}: must be {domain.describe(isinstance(v, float))}, got {v}"]


def _choice_error(path: str, value, choices: tuple) -> list[str]:
    if value in choices:
        return []
    named = [c for c in choices if c != ""]  # '' is "derive", documented in the help
    near = difflib.get_close_matches(str(value), [str(c) for c in named], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return [f"{path}: {value!r} is not one of {named}{hint}"]
