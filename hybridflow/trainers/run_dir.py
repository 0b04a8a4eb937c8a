"""A run's directory: its checkpoint manager and the claim `hybridflow train` makes on it (the lock, and
whether this run resumes there or goes on in a directory of its own: lifecycle.check_run_dir)."""

from __future__ import annotations

import itertools
import os
import sys

from hybridflow.checkpoint import CheckpointManager
from hybridflow.checkpoint.run_lock import RunDirLocked, RunLock
from hybridflow.config import config_to_dict
from hybridflow.trainers import lifecycle, supervised


def hashed_config(cfg) -> dict:
    """The config as hashed into checkpoint manifests: without run length and logging settings, which a
    resumed run may change freely (lifecycle.FREE_KEYS). Another hash is another run to trainer.resume=auto;
    a checkpoint named explicitly is resumed with a warning."""
    d = config_to_dict(cfg)
    for k in lifecycle.FREE_KEYS:
        d["trainer"].pop(k, None)
    return d


def checkpoint_manager(cfg) -> CheckpointManager:
    # absolute: worker processes write their parts there and need not share the driver's cwd
    return CheckpointManager(
        os.path.abspath(cfg.run_dir), keep_last=cfg.trainer.keep_last, config=hashed_config(cfg)
    )


def claim_run_dir(trainer) -> None:
    """Lock the trainer's run directory and decide how the run starts there (lifecycle.check_run_dir):
    sets trainer.run_lock and trainer.resume_path. With trainer.resume=auto a directory holding a finished
    or another run is left as it is: this run goes on in <experiment_name>-2 (-3, ...), the first that is
    free or holds this same run."""
    cfg = trainer.cfg
    first, name = cfg.run_dir, cfg.trainer.experiment_name
    why = ""
    for k in itertools.count(1):
        if k > 1:
            cfg.trainer.experiment_name = f"{name}-{k}"
            trainer.ckpt = checkpoint_manager(cfg)
        try:
            trainer.run_lock = RunLock(cfg.run_dir, pid=supervised.owner_pid())
        except RunDirLocked:
            if k == 1:
                raise
            continue  # another process runs there
        try:
            trainer.resume_path = lifecycle.check_run_dir(trainer)
        except lifecycle.AnotherRun as e:
            trainer.run_lock.release()
            why = why or str(e)
            continue
        except BaseException:
            trainer.run_lock.release()
            raise
        if k > 1:
            how = "resumes" if trainer.resume_path is not None else "starts in"
            print(f"hybridflow train: {first} holds {why}; this run {how} {cfg.run_dir}",
                  file=sys.stderr, flush=True)  # fmt: skip
        return
