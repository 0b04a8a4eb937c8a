"""Tools and environments given as Python objects (hybridflow.Run's `tools=` / `environment=`), by name.

The config names them `api:<name>` (rollout.multi_turn.tools / .environment), so it stays text (YAML,
the resume hash). The objects exist only in the process that registered them: the trainer sends the ones
its config names to the rollout workers by value (cloudpickle, `pickled`), which `install` them before
building the agent loop, so a function defined in a notebook or a `python -c` script works.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable

from hybridflow.agent.tools import Tool, function_schema
from hybridflow.config.agent import MultiTurnConfig
from hybridflow.errors import ConfigError

PREFIX = "api:"
_REGISTRY: dict[str, object] = {}


def register(obj: object, name: str) -> str:
    """Registers `obj` (a Tool, or an environment class / factory) -> the spec the config names it by."""
    key = PREFIX + name
    _REGISTRY[key] = obj
    return key


def is_registered(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def lookup(spec: str, key: str) -> object:
    """The object registered as `spec`; ConfigError in one line when this process has none."""
    if spec not in _REGISTRY:
        raise ConfigError(
            [f"{key}: {spec!r} names a tool or environment given to hybridflow.Run, and none is registered "
             "in this process (the 'api:' names exist only in the Python API's run)"]
        )  # fmt: skip
    return _REGISTRY[spec]


def named_in(cfg: MultiTurnConfig) -> dict[str, object]:
    """The registered objects `cfg` names (what its rollout workers need)."""
    specs = [s for s in [*cfg.tools, cfg.environment] if is_registered(s)]
    return {s: lookup(s, "rollout.multi_turn") for s in specs}


def pickled(cfg: MultiTurnConfig) -> bytes | None:
    """The registered objects `cfg` names, by value, for the rollout workers (None: none named)."""
    objects = named_in(cfg)
    if not objects:
        return None
    import cloudpickle

    try:
        return cloudpickle.dumps(objects)
    except Exception as e:
        raise ConfigError(
            [f"rollout.multi_turn: {sorted(objects)} cannot be sent to the rollout workers "
             f"({type(e).__name__}: {e}); keep what they use picklable (no open files, locks or sockets)"]
        ) from None  # fmt: skip


def install(blob: bytes | None) -> None:
    """In a worker: registers what `pickled` sent."""
    if blob:
        import cloudpickle

        _REGISTRY.update(cloudpickle.loads(blob))


def checked_tool(fn: Callable | Tool, where: str) -> Tool:
    """A Run's tool: a Tool as it is, or a function whose schema says what the model needs (a name, a
    description, a JSON type per parameter); else ConfigError in one line starting with `where`."""
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ConfigError([f"{where}: {fn!r} is not a callable"])
    name = getattr(fn, "__name__", "")
    if not name.isidentifier():
        raise ConfigError(
            [f"{where}: {name or fn!r} has no function name the model can call (a def, not a lambda)"]
        )
    hints = typing.get_type_hints(fn)
    schema = function_schema(fn)
    params = schema["function"]["parameters"]["properties"]
    untyped = [p for p, prop in params.items() if "type" not in prop]
    if untyped:
        raise ConfigError(
            [f"{where}: {name}'s parameters {untyped} need type hints of int, float, str, bool, list or dict "
             f"(got {[str(hints.get(p, 'none')) for p in untyped]}): their JSON schema is what the model sees"]
        )  # fmt: skip
    if not schema["function"]["description"]:
        raise ConfigError(
            [f"{where}: {name} has no docstring: its first paragraph tells the model what the tool does"]
        )
    return Tool(name, fn, schema)


def checked_environment(env: Callable, where: str) -> Callable:
    """A Run's environment: a class with `step`, or a factory (called with no arguments, once per
    trajectory); else ConfigError in one line."""
    if inspect.isclass(env):
        if not callable(getattr(env, "step", None)):
            raise ConfigError([f"{where}: {env.__name__} has no step(call, timeout_s) method"])
    elif not callable(env):
        raise ConfigError([f"{where}: {env!r} is neither an Environment class nor a factory callable"])
    required = [
        p.name
        for p in _parameters(env)
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise ConfigError(
            [f"{where}: it is called with no arguments, once per trajectory; it requires {required}"]
        )
    return env


def _parameters(obj: Callable) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(obj).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: taken on trust
        return []
