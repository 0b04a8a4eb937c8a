"""A run's directory: its checkpoint manager and the claim `hybridflow train` makes on it: the lock, and
whether this run resumes there (the same run: its algorithm, batch, model, training set and config hash
agree) or goes on in a directory of its own (check_run_dir)."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

from hybridflow.checkpoint import CheckpointError, CheckpointManager, load_trainer_state
from hybridflow.checkpoint.run_lock import RunDirLocked, RunLock
from hybridflow.config import config_to_dict
from hybridflow.trainers import supervised
from hybridflow.trainers.lifecycle import RunFinished


def hashed_config(cfg) -> dict:
    """The config as hashed into checkpoint manifests: without the settings a run may change and stay the
    same run (free_key). Another hash is another run to trainer.resume=auto; a checkpoint named explicitly
    is resumed with a warning."""

    def kept(tree: dict, prefix: str) -> dict:
        return {
            k: kept(v, f"{prefix}{k}.") if isinstance(v, dict) else v
            for k, v in tree.items()
            if not free_key(f"{prefix}{k}")
        }

    return kept(config_to_dict(cfg), "")


def checkpoint_manager(cfg) -> CheckpointManager:
    # absolute: worker processes write their parts there and need not share the driver's cwd
    return CheckpointManager(
        os.path.abspath(cfg.run_dir), keep_last=cfg.trainer.keep_last, config=hashed_config(cfg)
    )


def claim_run_dir(trainer) -> None:
    """Lock the trainer's run directory and decide how the run starts there (check_run_dir):
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
            trainer.resume_path = check_run_dir(trainer)
        except AnotherRun as e:
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


# ---- checks before any worker starts ------------------------------------------------------------------
MODEL_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size")  # fmt: skip


def resume_fingerprint(cfg) -> dict:
    """What a checkpoint must agree on with the run resuming it: batch arithmetic and model shapes."""
    out = {
        "data.train_batch_size": cfg.data.train_batch_size,
        "rollout.n": cfg.rollout.n,
        "model.path": _model_shape(cfg.model.path),
    }
    if cfg.model.critic_path:
        out["model.critic_path"] = _model_shape(cfg.model.critic_path)
    return out


def _model_shape(path: str) -> dict:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in MODEL_KEYS if k in config}


def fingerprint_difference(checkpoint: Path, manifest: dict, cfg) -> str | None:
    """How `checkpoint` differs from this run in batch or model (resume_fingerprint), or None."""
    saved = manifest.get("meta", {}).get("fingerprint")
    if not saved:
        return None  # a checkpoint without a fingerprint: nothing to compare against
    now = resume_fingerprint(cfg)
    for key, then in saved.items():
        if key not in now or now[key] == then:
            continue
        if isinstance(then, dict):
            diff = [f"{k} {then.get(k)} -> {now[key].get(k)}" for k in then if then.get(k) != now[key].get(k)]
            return f"the model at {key}={cfg_value(cfg, key)} differs from {checkpoint}'s ({', '.join(diff)})"
        return f"{checkpoint} was written with {key}={then}, this run has {now[key]}"
    return None


def cfg_value(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


class AnotherRun(Exception):
    """trainer.resume=auto found a finished run, or another run's checkpoint, in the run directory: it
    is left as it is and this run goes on in a directory of its own (claim_run_dir)."""


# trainer.* settings a resumed run may change: how long it runs, how it saves and logs, where it lives
FREE_KEYS = ("total_steps", "total_epochs", "val_every", "save_every", "keep_last", "resume", "loggers",
             "save_every_minutes", "max_restarts", "stop_grace_s", "hang_timeout_s", "restart_wait_s",
             "min_devices", "val_only", "rollout_data_dir", "validation_data_dir", "output_dir",
             "experiment_name")  # fmt: skip
# the layout: every checkpoint holds whole tensors by name, so it resumes onto other devices, parallel
# sizes, micro-batches and offload (engines/checkpoint_io.py), as a restart on fewer ranks does
LAYOUT_KEYS = ("micro_batch_size_per_device", "max_tokens_per_micro_batch", "gradient_checkpointing", "offload",
               "cpu_threads", "cpu_gemm", "tg", "num_workers", "chunk_size")  # fmt: skip


def free_key(dotted: str) -> bool:
    """Whether a run may change setting `dotted` (or a section of them) and stay the same run."""
    parts = dotted.split(".")
    if parts[0] == "trainer":
        return len(parts) == 2 and parts[1] in FREE_KEYS
    return parts[0] == "resources" or "parallel" in parts[1:] or (len(parts) > 1 and parts[-1] in LAYOUT_KEYS)


def check_run_dir(trainer) -> Path | None:
    """Before any worker starts (the run directory is locked): the checkpoint trainer.resume names, verified,
    checked to fit this run -> its path, or None for a fresh start. trainer.resume=auto resumes only this
    same run unfinished (same config hash, algorithm, batch, model and training set); a finished or
    different one raises AnotherRun. A checkpoint named explicitly (a step, a path) that cannot be resumed
    is a one-line CheckpointError; RunFinished when it is the final one (unless trainer.val_only)."""
    require = [*trainer.checkpoint_parts(), "trainer_state.json"]
    resume = trainer.cfg.trainer.resume
    auto = str(resume).strip().lower() == "auto"
    own_hash = trainer.ckpt.config_hash
    if auto:  # compared below: another config is another run, not a resume to warn about
        trainer.ckpt.config_hash = None
    try:  # named: the parts are checked below, after the algorithm (another one wrote other parts)
        path = trainer.ckpt.resolve(resume, require=require if auto else require[-1:])
    finally:
        trainer.ckpt.config_hash = own_hash
    if path is None:
        return None
    manifest = json.loads((path / "manifest.json").read_text())
    difference = resume_difference(trainer, path, manifest)
    if difference is None and (missing := [p for p in require if p not in manifest.get("parts", {})]):
        difference = f"{path} has no '{missing[0]}' part (it holds {sorted(manifest.get('parts', {}))})"
    if auto and difference is None:
        difference = config_difference(trainer, manifest)
    elif difference is None and (changed := config_difference(trainer, manifest)):  # resumed by name
        print(f"hybridflow train: warning: {path.name}: {changed}; optimizers resume as saved (their lr, betas, eps, "
              "weight decay and LR schedule, as in verl), every other setting is this run's", file=sys.stderr)  # fmt: skip
    if difference is not None:
        if auto:  # the run directory is named in the line already
            raise AnotherRun(f"another run ({difference.replace(str(path), path.name)})")
        raise CheckpointError(
            f"cannot resume: {difference}; keep the checkpoint's setting, or start a new run "
            "(trainer.resume=never or another trainer.experiment_name)"
        )
    if manifest["step"] >= trainer.total_steps and not trainer.cfg.trainer.val_only:
        reached = f"its checkpoint {path.name} reached trainer.total_steps={trainer.total_steps}"
        if auto:
            raise AnotherRun(f"a finished run ({reached}; raise trainer.total_steps to continue it)")
        raise RunFinished(
            f"{trainer.cfg.run_dir} is finished: {reached}; nothing to train (raise total_steps to "
            "continue, or use another trainer.experiment_name)"
        )
    return path


def resume_difference(trainer, path: Path, manifest: dict) -> str | None:
    """What keeps this run from resuming `path` (algorithm, batch, model, training set), or None."""
    written_by = manifest.get("meta", {}).get("algorithm", trainer.name)
    if written_by != trainer.name:
        return f"{path} was written by algorithm.name={written_by}, this run is {trainer.name}"
    if (difference := fingerprint_difference(path, manifest, trainer.cfg)) is not None:
        return difference
    loader = trainer.train_loader.state_dict() if trainer.train_loader is not None else {}
    saved = load_trainer_state(path).get("loader") or {}
    if "dataset_len" in loader and saved.get("dataset_len", loader["dataset_len"]) != loader["dataset_len"]:
        return (
            f"{path} was written with a training set of {saved['dataset_len']} prompts, this run has "
            f"{loader['dataset_len']} (data.train_files)"
        )
    return None


def config_difference(trainer, manifest: dict) -> str | None:
    """'its config differs (keys)' when the checkpoint's config hash is not this run's, else None."""
    saved = manifest.get("config_hash")
    if not saved or not trainer.ckpt.config_hash or saved == trainer.ckpt.config_hash:
        return None
    changed = changed_keys(Path(trainer.cfg.run_dir) / "config.yaml", trainer.cfg)
    return "its config differs" + (f": {', '.join(changed)}" if changed else "")


def changed_keys(written: Path, cfg, most: int = 4) -> list[str]:
    """The dotted keys whose values differ between a run directory's config.yaml and cfg (at most
    `most`, then how many more), leaving out the free ones (free_key); [] when config.yaml cannot be read."""
    from hybridflow.config import config_to_dict
    from hybridflow.config.loader import config_from_dict, load_yaml

    try:  # read as a config, so that both sides have the same types and defaults
        then = _flat(config_to_dict(config_from_dict(load_yaml(written))))
    except Exception:  # a config.yaml of an older layout, or none: the difference stays unnamed
        return []
    now = _flat(config_to_dict(cfg))
    keys = sorted(k for k in then.keys() | now.keys() if not free_key(k) and then.get(k) != now.get(k))
    return keys[:most] + ([f"{len(keys) - most} more"] if len(keys) > most else [])


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
