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

from hybridflow._lazy import lazy_exports

# loaded on first use (PEP 562), so CLI --help does not import torch
__getattr__ = lazy_exports(
    __name__,
    {
        "load_engine_state": "engine_state",
        "read_engine_info": "engine_state",
        "save_engine_state": "engine_state",
        "export_hf": "export",
        "CheckpointDiskFull": "manager",
        "CheckpointError": "manager",
        "CheckpointManager": "manager",
        "atomic_write_text": "manager",
        "config_hash": "manager",
        "find_checkpoint": "manager",
        "read_manifest": "manager",
        "capture_rng_state": "rng",
        "restore_rng_state": "rng",
        "TRAINER_STATE": "trainer_state",
        "load_trainer_state": "trainer_state",
        "save_trainer_state": "trainer_state",
    },
)

__all__ = [
    "TRAINER_STATE",
    "CheckpointDiskFull",
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
