"""Load the config tree from YAML plus dotted overrides, with errors that name the key.

A thin loader over dataclasses, without OmegaConf's structured configs (OmegaConf only resolves the
`${...}` of verl's YAMLs, config/verl.py): the features needed -- merge,
dotted overrides, type checks -- take ~100 lines here, while OmegaConf's structured-config merge
raises at the first bad key, so this module's error collection and nearest-key suggestions would
still be needed on top. Errors
here name the full key path, the expected type, the bad value and -- for typos -- the nearest valid
key, for every problem at once.

Order: dataclass defaults <- YAML file <- overrides (`actor.optim.lr=1e-5`, values parsed as YAML
flow scalars/lists/maps) -> typed tree -> each value in its field's domain (hybridflow/fields.py) ->
`resolve_config` (derived values) -> `validate_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from hybridflow.config.schema import HybridFlowConfig
from hybridflow.errors import ConfigError
from hybridflow.fields import domain_errors


# ---- schema introspection ----------------------------------------------------------------------
@functools.cache
def _hints(cls) -> dict[str, Any]:
    """The resolved annotations of a config class (cached: resolving them is most of a load's time)."""
    return typing.get_type_hints(cls)


def leaf_paths(cls=HybridFlowConfig, prefix: str = "") -> list[str]:
    """Every settable dotted key under `cls` (nested configs expand, their own key included)."""
    out = []
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        tp = _hints(cls)[f.name]
        out.append(path)
        if dataclasses.is_dataclass(tp):
            out.extend(leaf_paths(tp, path + "."))
    return out


def key_type(path: str, cls=HybridFlowConfig):
    """The annotated type of a dotted key (`data.dataset_kwargs` -> dict[str, Any])."""
    *parents, leaf = path.split(".")
    for part in parents:
        cls = _hints(cls)[part]
    return _hints(cls)[leaf]


def _suggest(key: str, path: str, candidates: list[str]) -> str:
    """' (did you mean 'actor.optim.lr'?)': a verl/TRL name's meaning first (config/aliases.py), then
    spelling: siblings, then any key with a close last part."""
    from hybridflow.config.aliases import alias_for

    alias = alias_for(path)
    if alias:
        return f" (did you mean '{alias}'? its verl/TRL name)"
    prefix = path.rpartition(".")[0]
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if near:
        return f" (did you mean '{prefix + '.' if prefix else ''}{near[0]}'?)"
    # a key at the wrong depth ('actor.lr'): prefer a close last part under the same section
    everywhere = leaf_paths()
    section = path.partition(".")[0]
    ranked = sorted(everywhere, key=lambda p: (p.partition(".")[0] != section, len(p)))
    last_parts = [p.rpartition(".")[2] for p in ranked]
    near = difflib.get_close_matches(key, last_parts, n=1, cutoff=0.75)
    if near:
        return f" (did you mean '{ranked[last_parts.index(near[0])]}'?)"
    near = difflib.get_close_matches(path, everywhere, n=1, cutoff=0.6)
    return f" (did you mean '{near[0]}'?)" if near else ""


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


# ---- coercion ----------------------------------------------------------------------------------
def _coerce(value: Any, tp, path: str, errors: list[str]) -> Any:
    """Return `value` converted to `tp`, or append an error naming `path` and return None."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], path, errors) if len(inner) == 1 else value
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
            return None
        return _build(tp, value, path, errors)
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, tuple):
            value = list(value)
        if isinstance(value, str) and item_tp is str:
            value = [value]  # `data.train_files=a.parquet` means a one-element list
        if not isinstance(value, list):
            errors.append(f"{path}: expected list[{_type_name(item_tp)}], got {value!r}")
            return None
        return [_coerce(v, item_tp, f"{path}[{i}]", errors) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return dict(value)
    bad = f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})"
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        errors.append(bad)
        return None
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        errors.append(bad)
        return None
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an int past the largest float
                errors.append(f"{path}: {value} is too large for a float")
                return None
        if isinstance(value, str):
            # YAML 1.1 reads `1e-5` (no dot) as a string; accept it as the number it obviously is.
            try:
                return float(value)
            except ValueError:
                pass
        errors.append(bad)
        return None
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        errors.append(bad)
        return None
    return value


def _build(cls, data: dict, path: str, errors: list[str]):
    """Instantiate dataclass `cls` from the defaults updated with `data` (a possibly partial mapping)."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in hints:
            errors.append(f"unknown key '{full}'{_suggest(str(key), full, names)}")
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            # nested partial mapping: start from this field's own default (e.g. critic lr=1e-5)
            default = next(f for f in dataclasses.fields(cls) if f.name == key).default_factory()
            base = config_to_dict(default)
            kwargs[key] = _build(tp, _deep_merge(base, value), full, errors)
        else:
            kwargs[key] = _coerce(value, tp, full, errors)
    return cls(**{k: v for k, v in kwargs.items() if v is not None or _allows_none(hints[k])})


def _allows_none(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# ---- public API --------------------------------------------------------------------------------
def config_to_dict(cfg) -> dict:
    """A plain nested dict (YAML-ready) of a config dataclass."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict | None, cls=HybridFlowConfig):
    """Build a typed config from a nested mapping; raises ConfigError listing every bad key/value."""
    from hybridflow.config.aliases import normalize_values

    errors: list[str] = []
    cfg = _build(cls, normalize_values(_deep_merge({}, data or {})), "", errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def parse_override(item: str) -> tuple[str, Any]:
    """'actor.optim.lr=1e-5' -> ('actor.optim.lr', 1e-5). Values are YAML flow values ([a, b], {k: v})."""
    key, sep, raw = item.partition("=")
    key = key.strip().lstrip("+")  # tolerate Hydra's '+key=value'
    if not sep or not key:
        raise ConfigError([f"override {item!r} is not of the form key.path=value"])
    raw = raw.strip()
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw  # e.g. an unquoted string with a colon; the type check decides
    return key, value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Return `data` with each dotted override set (unknown keys are reported later, by full path)."""
    out = _deep_merge({}, data)
    for item in overrides:
        key, value = parse_override(item)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:  # copies on the way down: `data`'s own mappings are the caller's
            node[part] = dict(node[part]) if isinstance(node.get(part), dict) else {}
            node = node[part]
        node[parts[-1]] = value
    return out


def yaml_error_line(path: str | os.PathLike, error: yaml.YAMLError) -> str:
    """PyYAML's several-line message as one line: `file:LINE:COL: not valid YAML: problem (context)`,
    lines and columns counted from 1 as editors do."""
    mark = getattr(error, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    problem = getattr(error, "problem", None) or str(error)
    context, cmark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and cmark:
        context += f" at line {cmark.line + 1}, column {cmark.column + 1}"
    line = f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")
    return " ".join(line.split())


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last silently,
    so a setting written twice (an edit that added a key the file already had) would lose one unseen.
    Keys a merge (`<<: *base`) brings in may still be overridden: that is what merging is for."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        f"in the mapping at line {node.start_mark.line + 1}",
                        None,
                        f"found duplicate key {key!r} (first at line {seen[key].line + 1}); keep one",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)


def load_yaml(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as f:  # bytes: PyYAML reports undecodable text as a YAMLError with its place
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except FileNotFoundError:
        raise ConfigError([f"config file {str(path)!r} does not exist"]) from None
    except IsADirectoryError:
        raise ConfigError([f"config file {str(path)!r} is a directory; name a YAML file in it"]) from None
    except OSError as e:  # no permission, an I/O error
        raise ConfigError([f"config file {str(path)!r} cannot be read: {e.strerror or e}"]) from None
    except yaml.reader.ReaderError as e:  # not UTF-8 (or UTF-16) text, or a control character
        if e.encoding != "unicode":  # a byte that does not decode ("unicode": a decoded character refused)
            raise ConfigError(
                [f"{path}: not UTF-8 text (byte {e.character:#04x} at offset {e.position})"]
            ) from None
        why = f"a control character ({e.character:#04x} at character {e.position})"
        raise ConfigError([f"{path}: not valid YAML: {why}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([yaml_error_line(path, e)]) from None
    except RecursionError:
        raise ConfigError(
            [f"{path}: not valid YAML: nested deeper than the reader's recursion limit"]
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping of sections, got {type(data).__name__}"])
    return data


# settings that name files or directories: `~` and $VARS in them are expanded, as a shell would (verl's
# own defaults use `~/data/...`, `~/models/...`)
PATH_KEYS = (
    "model.path", "model.tokenizer_path", "model.critic_path", "model.reward_model_path",
    "model.cost_model_path", "data.train_files", "data.val_files", "reward.fn", "trainer.output_dir",
    "trainer.rollout_data_dir", "trainer.validation_data_dir", "trainer.resume",
)  # fmt: skip


def expand_paths(data: dict) -> dict:
    """`data` with ~ and environment variables expanded in the PATH_KEYS values (strings, lists of them)."""

    def expand(v):
        if isinstance(v, str):
            return os.path.expandvars(os.path.expanduser(v))
        return [expand(x) for x in v] if isinstance(v, list) else v

    out = data
    for key in PATH_KEYS:
        section, leaf = key.split(".")
        node = data.get(section)
        if isinstance(node, dict) and leaf in node and expand(node[leaf]) != node[leaf]:
            out = out if out is not data else {**data}
            out[section] = {**out[section], leaf: expand(node[leaf])}
    return out


def _print_note(note: str) -> None:
    import sys

    print(f"hybridflow: {note}", file=sys.stderr)


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    resolve: bool = True,
    validate: bool = True,
    check_model: bool = True,
    verl: bool | None = None,
    notes=None,
    data: dict | None = None,
) -> HybridFlowConfig:
    """defaults <- YAML `path` (or the nested mapping `data`) <- `overrides`, typed, resolved and
    validated (raises ConfigError).

    check_model: look at the disk: the model directory (its config.json: lengths against the context)
    and that the data files exist.
    verl: read verl's layout and keys (config/verl.py; None = when a verl-only section appears);
    each verl key without an equivalent is passed to `notes` (default: printed to stderr).
    """
    from hybridflow.config.verl import from_verl, is_verl_config

    data = load_yaml(path) if path else dict(data or {})
    if verl or (verl is None and is_verl_config(data, overrides)):
        data, verl_notes = from_verl(data, overrides)
        overrides = ()
        for note in verl_notes:
            (notes or _print_note)(note)
    cfg = config_from_dict(expand_paths(apply_overrides(data, overrides)))
    if validate and domain_errors(cfg):  # as given: resolve_config derives from them (critic's from actor's)
        raise ConfigError(domain_errors(cfg))
    if check_model:  # model names -> absolute local directories (or cached Hub snapshots)
        from hybridflow.models.resolve import resolve_model_paths

        errors = resolve_model_paths(cfg.model)
        if errors:
            raise ConfigError(errors)
    if not (resolve or validate):  # the checks import the rollout engines (torch); this needs none
        return cfg
    from hybridflow.config.validate import derived_conflicts, resolve_config, validate_config

    if resolve:
        given, cfg = cfg, resolve_config(cfg)
        if validate and derived_conflicts(given, cfg):
            raise ConfigError(derived_conflicts(given, cfg))
    if validate:
        validate_config(cfg, check_model=check_model)
    return cfg
