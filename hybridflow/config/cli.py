"""`hybridflow config show CONFIG [key.path=value ...]`: print the fully resolved config as YAML.

Every default is printed, derived values are filled in, and the result is validated, so what the
command prints is exactly what `hybridflow train` with the same arguments would run. `--comments`
adds each field's help string; `hybridflow config --help` lists every key with type and default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

import yaml

from hybridflow.config.loader import load_config
from hybridflow.config.schema import HybridFlowConfig
from hybridflow.errors import ConfigError


def _scalar(value) -> str:
    """One YAML flow value (strings quoted only when needed, lists/dicts inline; reward.fns' entries as maps)."""
    if isinstance(value, list):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...").strip()


def allowed(f: dataclasses.Field, default) -> str:
    """' [a|b]' (choices) or ' [>= 1]' (a number's domain) after a field's help; '' for the rest."""
    choices = f.metadata.get("choices")
    if choices:
        return f" [{'|'.join(str(c) for c in choices if c != '')}]"
    domain = f.metadata.get("domain")
    is_float = isinstance(default, float) or (
        isinstance(default, list) and any(isinstance(v, float) for v in default)
    )
    return f" [{domain.describe(is_float)}]" if domain else ""


def to_yaml(cfg, comments: bool = False, indent: int = 0) -> str:
    """YAML text of a config dataclass; with `comments`, each line ends with the field's help."""
    lines = []
    pad = "  " * indent
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        help_ = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{f.name}:" + (f"  # {help_}" if comments and help_ else ""))
            lines.append(to_yaml(value, comments, indent + 1))
        else:
            line = f"{pad}{f.name}: {_scalar(value)}"
            if comments and help_:
                line += f"  # {help_}{allowed(f, value)}"
            lines.append(line)
    return "\n".join(lines)


def field_reference(cls=HybridFlowConfig, prefix: str = "") -> str:
    """'key (type, default): help' for every field: the text of `hybridflow config --help`."""
    hints = typing.get_type_hints(cls)
    default = cls()
    lines = []
    for f in dataclasses.fields(cls):
        tp, value, path = hints[f.name], getattr(default, f.name), prefix + f.name
        if dataclasses.is_dataclass(tp):
            lines.append(f"\n{path}: {f.metadata.get('help', '')}")
            lines.append(field_reference(tp, path + "."))
            continue
        name = tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")
        lines.append(
            f"  {path} ({name}, default {_scalar(value)}): {f.metadata.get('help', '')}{allowed(f, value)}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "fields (set in YAML or as key.path=value):" + field_reference()
    parser.add_argument("action", choices=["show"], help="show: print the resolved config")
    parser.add_argument("config", nargs="?", help="YAML config file (omit for pure defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-5")
    parser.add_argument("--comments", action="store_true", help="append each field's help as a comment")
    parser.add_argument("--no-validate", action="store_true", help="print even if the config is inconsistent")
    parser.add_argument(
        "--verl", action="store_true", help="read verl's config layout and keys (docs/verl.md)"
    )


def run(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # only overrides were given
    try:
        cfg = load_config(config, overrides, validate=not args.no_validate, verl=True if args.verl else None)
    except ConfigError as e:
        print(f"hybridflow config: {e}", file=sys.stderr)
        return 2
    print(to_yaml(cfg, comments=args.comments))
    return 0
