"""The `hybridflow` console script: one subcommand per user task.

Each subcommand lives in the package area that owns it and exposes `add_arguments(parser)` and
`run(args) -> int`; this file only wires them up, importing lazily so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "train": ("hybridflow.trainers.cli", "run an algorithm from a YAML config with dotted overrides"),
    "eval": ("hybridflow.trainers.eval_cli", "validation only, from a checkpoint or an HF directory"),
    "export": ("hybridflow.checkpoint.export_cli", "checkpoint -> plain HF directory"),
    "config": ("hybridflow.config.cli", "show the fully resolved config with every default"),
    "data": ("hybridflow.data.cli", "preprocess datasets (gsm8k, math) into Parquet"),
    "report": ("hybridflow.logging.report", "plot a run directory's metrics to PNG and HTML"),
    "plan": ("hybridflow.planner.cli", "auto-mapping: choose placement and parallelism"),
    "calibrate": ("hybridflow.planner.calibrate", "measure this machine vs the planner's predictions"),
}


def build_parser() -> argparse.ArgumentParser:
    from hybridflow import __version__

    parser = argparse.ArgumentParser(prog="hybridflow", description="RL post-training of LLMs (HybridFlow).")
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        # only the command being run imports its module (and that module imports torch/Ray lazily)
        if name in sys.argv[1:2]:
            try:
                importlib.import_module(module).add_arguments(p)
            except ModuleNotFoundError as e:
                if e.name and e.name.startswith("hybridflow"):
                    p.set_defaults(_missing=str(e))
                else:
                    raise
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:])
    # argparse stops filling positionals at an option (`config show --verl a=b`): the rest are overrides
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*(args.overrides or []), *extra]
    elif extra:
        parser.parse_args(sys.argv[1:])  # the usual "unrecognized arguments" error and exit 2
    if not args.command:
        parser.print_help()
        return 0
    if getattr(args, "_missing", None):
        print(f"hybridflow {args.command}: not available in this build ({args._missing})", file=sys.stderr)
        return 2
    args._own_command_line = argv is None  # this process is the command the user ran (not a call from Python)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
