"""`hybridflow eval SOURCE [key.path=value ...]`: validation only, from a checkpoint or an HF directory.

SOURCE is a run directory (its latest checkpoint; `--step N` picks another), a checkpoints/step_N
directory, or a plain HF model directory (e.g. what `hybridflow export` wrote). The settings come
from `--config`, else from the run's own config.yaml (written by `hybridflow train`), else the
defaults; overrides apply last (e.g. `rollout.val.n=4` for mean@4, `data.val_files=[...]`). The
model is the checkpoint's actor, exported from its shards into a temporary directory, generated with `rollout.val` sampling
and scored by the run's reward, exactly as validation inside `train` does, so the numbers match the
run's `val/*` metrics for that step.

Prints `val/{data_source}/acc@1` (and mean@n / best@n / maj@n / pass@k when rollout.val.n > 1) one per line and a
table of sample generations; `--output FILE` also writes the metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def build_eval_trainer(cfg):
    """A trainer with the policy (and a reward model, if configured) and no training data.
    (Defined on call so that `hybridflow --help` does not import torch and Ray.)"""
    from hybridflow.trainers.base import Trainer

    class EvalTrainer(Trainer):
        name = "eval"
        owns_run_dir = False  # reads a checkpoint; may run beside the training run that writes it

        def roles(self) -> dict[str, dict]:
            return {"actor_rollout": {}, **({"reward": {}} if self.cfg.reward.kind == "model" else {})}

        def build_train_loader(self):
            return None

    return EvalTrainer(cfg)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="a run directory, a checkpoints/step_N directory, an HF model directory, or a Hub id in the local cache",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.val.n=4")
    parser.add_argument("--config", default=None, help="YAML config (default: SOURCE's run config.yaml)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--output", default=None, help="also write the metrics to this JSON file")


def resolve_source(source: str, step: int | None, scratch: str | None = None) -> tuple[Path, Path | None]:
    """-> (HF model directory, the run's config.yaml or None). A checkpoint's sharded actor is exported
    (streamed, checkpoint/export.py) into `scratch` first."""
    from hybridflow.checkpoint import CheckpointError, export_hf, find_checkpoint, read_manifest
    from hybridflow.checkpoint.engine_state import read_engine_info

    path = Path(source)
    if not path.exists():  # a Hub id such as Qwen/Qwen2.5-0.5B-Instruct: its local cache snapshot
        from hybridflow.errors import ModelNotFound
        from hybridflow.models.resolve import resolve_model_path

        try:
            path = Path(resolve_model_path(source))
        except ModelNotFound as e:
            raise CheckpointError(str(e)) from None
    if (path / "config.json").is_file() and not (path / "manifest.json").is_file():
        if step is not None:
            raise CheckpointError(f"--step {step} needs a run or checkpoint directory; {path} is an HF model")
        return path, None
    step_dir = find_checkpoint(path, step)
    read_manifest(step_dir, require=["actor"])
    hf = step_dir / "actor" / "hf"  # a full copy, in checkpoints of earlier versions
    if not (hf / "config.json").is_file():
        if scratch is None:
            raise CheckpointError(f"{step_dir}/actor needs exporting first (hybridflow export)")
        lora = "lora" in read_engine_info(step_dir / "actor")  # adapters only: evaluate the merged model
        hf = export_hf(step_dir, Path(scratch) / "actor", merge=lora)
    run_config = step_dir.parent.parent / "config.yaml"
    return hf, run_config if run_config.is_file() else None


def evaluate(
    source: str, overrides=(), config: str | None = None, step: int | None = None
) -> tuple[dict, list]:
    """Validation metrics of SOURCE (see the module docstring) -> (metrics, sample generation rows)."""
    with tempfile.TemporaryDirectory(prefix="hybridflow-eval-") as scratch:
        model_dir, run_config = resolve_source(source, step, scratch)
        return _evaluate(model_dir, run_config, source, overrides, config)


def _evaluate(model_dir, run_config, source, overrides, config) -> tuple[dict, list]:
    from hybridflow.config import ConfigError, load_config

    base = [f"model.path={model_dir}", f"model.tokenizer_path={model_dir}", "trainer.resume=never"]
    cfg = load_config(config or run_config, base + list(overrides), validate=False)
    d = cfg.data
    if not (d.val_files or d.dataset):
        hint = "pass --config CONFIG or set data.val_files=[...] / data.dataset=..."
        raise ConfigError([f"no validation data for {source}: {hint}"])
    if not d.train_files and not d.dataset:
        d.train_files = list(d.val_files)  # satisfies the config checks; eval never reads training data
    trainer = build_eval_trainer(cfg)
    rows: list[dict] = []

    class _Rows:  # collects the generations table validate() logs
        def log_generations(self, r, step):
            rows.extend(r)

    try:
        trainer.tracker = _Rows()
        return trainer.validate(), rows
    finally:
        trainer.tracker = None
        trainer.close()


def run(args: argparse.Namespace) -> int:
    import ray

    from hybridflow.logging.backends import ConsoleBackend
    from hybridflow.trainers.cli import one_line, user_errors

    embedded = not ray.is_initialized()
    try:
        metrics, rows = evaluate(args.source, args.overrides, args.config, args.step)
    except (*user_errors(), FileNotFoundError) as e:
        print(f"hybridflow eval: {one_line(e)}", file=sys.stderr)
        return 2
    finally:
        if embedded and ray.is_initialized():
            ray.shutdown()
    if rows:
        ConsoleBackend(stream=sys.stdout).log_table("val/generations", rows, 0)
    for k, v in sorted(metrics.items()):
        print(f"{k} = {v:.4f}")
    if args.output:
        Path(args.output).write_text(json.dumps(metrics, indent=1))
    return 0
