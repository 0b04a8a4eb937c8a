"""`hybridflow train CONFIG [key.path=value ...]`: build everything from the config and run the driver.

Without resources.ray_address an embedded local Ray cluster is started (and stopped at the end);
with one, the run joins that cluster. With trainer.resume=auto (the default) a run directory that
holds this same run unfinished continues from its latest checkpoint; one holding a finished run or
another run (another config, algorithm, batch, model or training set) is left alone and this run starts
in <experiment_name>-2 (-3, ...), saying so in one line. At the end the run's report (report.png/html) is
written next to metrics.jsonl. Exit code 0 on success (also when trainer.resume names the final
checkpoint: nothing is trained), 2 on a user error (hybridflow/errors.py: config, data files, reward code,
model directories, checkpoints, a run directory in use; or a run stopped by a safety check such as
reward.max_error_fraction or trainer.max_skipped_steps): one line on stderr, no traceback; 128 + signal
number after SIGTERM (143) / SIGINT (130): the step in flight and a checkpoint are finished first, a
second signal abandons them; every process the run started is stopped either way (docs/operations.md).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see examples/configs), or the first override")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-5 trainer.total_steps=10"
    )
    parser.add_argument(
        "--verl",
        action="store_true",
        help="read verl's config layout and keys (docs/verl.md); detected when a verl-only section is used",
    )


def one_line(error: Exception) -> str:
    """A user error as one line: a ConfigError's problems joined with '; '."""
    problems = getattr(error, "errors", None)
    if problems:
        return "invalid config: " + "; ".join(problems)
    return " ".join(str(error).split())


def split_config_arg(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    """A command line of overrides only (verl's style: no YAML file) -> (None, all overrides)."""
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    return config, overrides


def user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix (reported in one line, exit 2), not bugs (tracebacks)."""
    from hybridflow.checkpoint import CheckpointError
    from hybridflow.errors import UserError  # config, data, reward code, model files (hybridflow/errors.py)

    return UserError, CheckpointError


def check_this_machine(cfg) -> None:
    """The devices the run asks for exist here (config/run_config.py machine_errors) and its model
    directories hold weights (config/model_checks.py model_weight_errors), before Ray starts;
    what runs but slowly here (machine_warnings) is one line each on stderr."""
    from hybridflow.config.model_checks import model_weight_errors
    from hybridflow.config.run_config import machine_errors, machine_warnings
    from hybridflow.errors import ConfigError

    errors = machine_errors(cfg.resources) + model_weight_errors(cfg)
    if errors:
        raise ConfigError(errors)
    for warning in machine_warnings(cfg.resources):
        print(f"hybridflow train: warning: {warning}", file=sys.stderr)


def say_faster_setting(cfg, load) -> None:
    """One line when the planner predicts a faster setting these resources allow (trainers/speed_hint.py).
    Advice only: a config the planner cannot price gets no line, never a failed start."""
    from hybridflow.trainers.speed_hint import faster_setting

    try:
        line = faster_setting(cfg, load)
    except Exception as e:  # noqa: BLE001 - the hint must not stop a run the config allows
        logging.getLogger(__name__).debug("no speed hint: %s", e)
        return
    if line:
        print(f"hybridflow train: {line}", flush=True)


def startup_line(cfg) -> str:
    """What the run is, before anything heavy starts: the model, the devices and how they are split."""
    r, actor = cfg.resources, cfg.actor.parallel
    devices = r.n_gpus_per_node * r.nnodes
    dp = actor.dp or "auto"
    pools = (
        f"rollout pool {r.rollout_devices} + training {devices - r.rollout_devices}"
        if r.rollout_devices
        else "one pool"
    )
    return (f"{cfg.algorithm.name} on {cfg.model.path}; {devices} device(s) ({r.nnodes} node x {r.n_gpus_per_node}, "
            f"{r.device}); actor dp {dp} tp {actor.tp} pp {actor.pp}, rollout tg {cfg.rollout.tg}; "
            f"placement {r.placement}, {pools}; run dir {cfg.run_dir}")  # fmt: skip


def say_startup(args: argparse.Namespace) -> None:
    """The start-up line, from the config as given (no checks, no model look-up: those import torch and
    take seconds); a config that does not load gets no line here, its one-line error comes from train."""
    from hybridflow.config import load_config
    from hybridflow.errors import UserError
    from hybridflow.fields import domain_errors

    config, overrides = split_config_arg(args.config, list(args.overrides))
    try:
        cfg = load_config(config, overrides, resolve=False, validate=False, check_model=False,
                          verl=True if args.verl else None, notes=lambda note: None)  # fmt: skip
    except (UserError, OSError):
        return
    if domain_errors(cfg):  # a value out of its range: train's one-line error is all the user sees
        return
    print(f"hybridflow train: {startup_line(cfg)}", flush=True)


def run(args: argparse.Namespace) -> int:
    """`hybridflow train` typed by a user supervises a driver (supervisor.py) that runs `train` below."""
    say_startup(args)
    if getattr(args, "_own_command_line", False):
        from hybridflow.trainers import supervisor

        return supervisor.main([*(["--verl"] if args.verl else []), args.config, *args.overrides])
    return train(args)


def train(args: argparse.Namespace) -> int:
    import ray

    from hybridflow.compat.versions import log_and_check_versions
    from hybridflow.config import load_config
    from hybridflow.config.verl import VerlNotes
    from hybridflow.controller import WorkerDiedError
    from hybridflow.trainers import build_trainer, cluster_loss, supervised
    from hybridflow.trainers.elastic import DevicesLost
    from hybridflow.trainers.lifecycle import Abandoned, Preempted, RunFinished, StopSignals

    supervised.attach()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        log_and_check_versions()  # before Ray or any worker: a too-old torch/transformers fails here, in one line
        config, overrides = split_config_arg(args.config, list(args.overrides))
        verl_notes = VerlNotes()
        cfg = load_config(config, overrides, verl=True if args.verl else None, notes=verl_notes)
        check_this_machine(cfg)
        if not supervised.restarts_before():  # said once, not again by a restarted driver
            say_faster_setting(
                cfg,
                lambda extra: load_config(
                    config, [*overrides, *extra], verl=True if args.verl else None, notes=lambda note: None
                ),
            )
        if supervised.resume_from():  # a restart after a lost cluster: from its predecessor's last checkpoint
            cfg.trainer.resume = supervised.resume_from()
        supervised.report(max_restarts=cfg.trainer.max_restarts)
    except user_errors() as e:
        print(f"hybridflow train: {one_line(e)}", file=sys.stderr)
        return 2
    embedded = not cfg.resources.ray_address and not ray.is_initialized()
    # the outcome is printed before the shutdown, which a lost GCS cuts short
    trainer, rc, trained = None, 1, False
    with StopSignals(cfg.trainer.stop_grace_s) as signals:
        try:
            with signals.running():  # an Abandoned raised as it ends is caught below, not in the shutdown
                trainer = build_trainer(cfg)
                cfg.trainer.experiment_name = trainer.cfg.trainer.experiment_name  # it may move (resume=auto)
                if verl_notes.ignored and not supervised.restarts_before():
                    print(f"hybridflow: {verl_notes.write(cfg.run_dir)}", file=sys.stderr, flush=True)
                history = trainer.fit()
            val = {
                k: round(v, 4) for k, v in (history[-1] if history else {}).items() if k.startswith("val/")
            }
            print(f"hybridflow train: done, {trainer.global_step} steps; final {val}; run dir {cfg.run_dir}")
            rc, trained = 0, True
        except RunFinished as e:
            print(f"hybridflow train: {one_line(e)}")
            rc = 0
        except user_errors() as e:
            print(f"hybridflow train: {one_line(e)}", file=sys.stderr)
            rc = 2
        except Preempted as e:
            print(f"hybridflow train: {e}", file=sys.stderr)
            rc = 128 + e.signum
        except Abandoned as e:
            latest = trainer.latest_checkpoint() if trainer is not None else None
            print(f"hybridflow train: {e}; latest checkpoint: {latest}", file=sys.stderr)
            rc = 128 + e.signum
        except cluster_loss.ClusterLost as e:  # supervised: the supervisor restarts (its line); else stop
            if not supervised.active():
                print(f"hybridflow train: {e}", file=sys.stderr)
            rc = 1
        except (WorkerDiedError, DevicesLost) as e:
            restarts = trainer.restarts if trainer is not None else 0
            print(f"hybridflow train: failed after {restarts} restarts: {one_line(e)}", file=sys.stderr)
            rc = 1
        finally:
            shut_down(trainer, embedded, rc)  # signals are only noted now (StopSignals.running)
    if trained:
        write_report_if_logged(cfg)
    return rc


def shut_down(trainer, embedded: bool, rc: int) -> None:
    """The run's workers and (embedded) cluster, after its outcome `rc` is printed and reported."""
    import ray

    from hybridflow.trainers import cluster_loss, supervised
    from hybridflow.trainers.lifecycle import reaper_pid, stop_reaper

    lost = cluster_loss.lost_processes() if embedded else []
    supervised.report(closing=rc, lost=lost)
    if rc == 1 and lost and supervised.active():
        supervised.await_kill()  # the supervisor kills this run's processes, names the loss, restarts
    sys.stdout.flush()
    # a lost GCS or raylet: kill by pid and leave with rc instead (trainers/cluster_loss.py); not
    # around ray.shutdown, which stops the GCS and raylet itself (one check just before it)
    with cluster_loss.watch(lambda: rc, keep={reaper_pid()}) if embedded else contextlib.nullcontext():
        if trainer is not None:
            trainer.close()
    if embedded and ray.is_initialized():
        cluster_loss.exit_if_lost(rc, keep={reaper_pid()})
        ray.shutdown()
    stop_reaper()


def write_report_if_logged(cfg) -> None:
    """report.png/html of the run, when it logs metrics.jsonl (a failing plot never fails the run)."""
    if "jsonl" not in cfg.trainer.loggers:
        return
    from hybridflow.logging import write_report

    try:
        png, _ = write_report(cfg.run_dir)
    except Exception as e:  # the run itself succeeded; the plot is a convenience
        print(f"hybridflow train: report not written ({one_line(e)})", file=sys.stderr)
        return
    print(f"hybridflow train: report {png}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridflow train")
    add_arguments(parser)
    return train(parser.parse_args(argv))  # the supervised driver: `run` said the start-up line already


if __name__ == "__main__":  # the driver `hybridflow train` supervises
    code = main()
    for s in (signal.SIGTERM, signal.SIGINT):  # its outcome is out: a late signal must not cut its exit
        signal.signal(s, signal.SIG_IGN)
    sys.exit(code)
