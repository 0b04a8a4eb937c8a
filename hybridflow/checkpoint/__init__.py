"""Checkpoints, exact resume and export.

Driver side (one process):
    manager = CheckpointManager(cfg.run_dir, keep_last=cfg.trainer.keep_last, config=cfg)
    with manager.writing(step, meta={"tokenizer_dir": ...}) as tmp:   # atomic; `latest` moves on commit
        actor_wg.save_checkpoint(str(tmp / "actor"))                  # workers: save_engine_state
        save_trainer_state(tmp, {"step": step, "dataloader": loader.state_dict(), ...})
    step_dir = manager.resolve(cfg.trainer.resume)                    # None on a fresh run
Worker side (every rank): save_engine_state(engine, path, rank) / load_engine_state(engine, path, rank).
Export: export_hf(run_dir_or_step_dir, out_dir) or `hybridflow export`.
"""

from hybridflow.checkpoint.engine_state import load_engine_state, read_engine_info, save_engine_state
from hybridflow.checkpoint.export import export_hf
from hybridflow.checkpoint.manager import (
    CheckpointError,
    CheckpointManager,
    atomic_write_text,
    config_hash,
    find_checkpoint,
    read_manifest,
)
from hybridflow.checkpoint.rng import capture_rng_state, restore_rng_state
from hybridflow.checkpoint.trainer_state import TRAINER_STATE, load_trainer_state, save_trainer_state

__all__ = [
    "TRAINER_STATE",
    "CheckpointError",
    "CheckpointManager",
    "atomic_write_text",
    "capture_rng_state",
    "config_hash",
    "export_hf",
    "find_checkpoint",
    "load_engine_state",
    "load_trainer_state",
    "read_engine_info",
    "read_manifest",
    "restore_rng_state",
    "save_engine_state",
    "save_trainer_state",
]
