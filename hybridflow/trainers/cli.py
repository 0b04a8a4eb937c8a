"""`hybridflow train CONFIG [key.path=value ...]`: build everything from the config and run the driver.

Without resources.ray_address an embedded local Ray cluster is started (and stopped at the end);
with one, the run joins that cluster. Exit code 0 on success, 2 on a config error.
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see examples/configs)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-5 trainer.total_steps=10"
    )


def run(args: argparse.Namespace) -> int:
    import ray

    from hybridflow.config import ConfigError, load_config
    from hybridflow.trainers import build_trainer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as e:
        print(f"hybridflow train: {e}", file=sys.stderr)
        return 2
    embedded = not cfg.resources.ray_address and not ray.is_initialized()
    try:
        try:
            trainer = build_trainer(cfg)
        except ConfigError as e:
            print(f"hybridflow train: {e}", file=sys.stderr)
            return 2
        try:
            history = trainer.fit()
        finally:
            trainer.close()
        val = {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("val/")}
        print(
            f"hybridflow train: done, {trainer.global_step} steps; final {val}; run dir {trainer.cfg.run_dir}"
        )
        return 0
    finally:
        if embedded and ray.is_initialized():
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow train")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
