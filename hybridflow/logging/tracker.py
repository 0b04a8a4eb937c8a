"""The Tracker: one `log(metrics, step)` call fans out to every configured sink.

    tracker = build_tracker(cfg, total_steps=100, resume_step=start_step)
    tracker.log({"reward/mean": 0.4, "timing_s/generate": 1.2}, step)
    tracker.log_generations([{"prompt": ..., "response": ..., "ground_truth": ..., "score": 1.0}], step)
    tracker.close()

Sinks are named by `trainer.loggers`: console, jsonl, tensorboard, wandb, mlflow. Non-numeric or
non-finite metric values are dropped (they cannot be plotted), so callers may pass tensors freely.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hybridflow.logging.backends import (
    ConsoleBackend,
    JsonlBackend,
    MlflowBackend,
    TensorBoardBackend,
    TrackerError,
    WandbBackend,
    to_float,
)

KNOWN = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


class Tracker:
    def __init__(
        self,
        run_dir: str | os.PathLike,
        loggers=("console", "jsonl"),
        *,
        config: dict | None = None,
        project_name: str = "hybridflow",
        experiment_name: str = "",
        total_steps: int | None = None,
        resume_step: int | None = None,
        stream=None,
    ):
        unknown = [n for n in loggers if n not in KNOWN]
        if unknown:
            raise TrackerError(f"trainer.loggers: unknown logger(s) {unknown}; choose from {list(KNOWN)}")
        self.run_dir = run_dir
        name = experiment_name or os.path.basename(os.fspath(run_dir))
        self.backends = []
        for n in loggers:
            if n == "console":
                self.backends.append(ConsoleBackend(total_steps, resume_step or 0, stream, run_dir))
            elif n == "jsonl":
                self.backends.append(JsonlBackend(run_dir, resume_step))
            elif n == "tensorboard":
                self.backends.append(TensorBoardBackend(run_dir))
            elif n == "wandb":
                self.backends.append(WandbBackend(run_dir, project_name, name, config))
            elif n == "mlflow":
                self.backends.append(MlflowBackend(run_dir, project_name, name, config))

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        clean = {k: f for k, v in metrics.items() if (f := to_float(v)) is not None}
        for b in self.backends:
            b.log(clean, step)

    def log_generations(self, rows: list[dict], step: int, name: str = "val/generations") -> None:
        """A table of sample generations (e.g. prompt, response, ground_truth, score)."""
        for b in self.backends:
            b.log_table(name, rows, step)

    def close(self) -> None:
        for b in self.backends:
            b.close()
        self.backends = []

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_tracker(
    cfg, total_steps: int | None = None, resume_step: int | None = None, stream=None
) -> Tracker:
    """A Tracker for a HybridFlowConfig: run dir, loggers, project/experiment names, config as params."""
    from hybridflow.config import config_to_dict

    trainer_cfg = cfg.trainer
    return Tracker(
        cfg.run_dir,
        trainer_cfg.loggers,
        config=config_to_dict(cfg),
        project_name=trainer_cfg.project_name,
        experiment_name=trainer_cfg.experiment_name,
        total_steps=total_steps,
        resume_step=resume_step,
        stream=stream,
    )
