"""Observability: the Tracker fan-out (console progress, JSONL, TensorBoard, wandb, MLflow) and
`hybridflow report` (PNG + HTML of a run's metrics)."""

from hybridflow.logging.backends import TrackerError
from hybridflow.logging.report import read_metrics, write_report
from hybridflow.logging.tracker import Tracker, build_tracker

__all__ = ["Tracker", "TrackerError", "build_tracker", "read_metrics", "write_report"]
