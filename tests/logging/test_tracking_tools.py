"""wandb (offline, files under WANDB_DIR) and MLflow (a SQLite store inside the run directory) through a
real `hybridflow train`: the numbers they hold are the run's own metrics.jsonl numbers."""

from __future__ import annotations

import json
import re

import pytest

from hybridflow.cli import main

pytest.importorskip("wandb", reason="installed by `make venv` (the wandb extra)")
pytest.importorskip("mlflow", reason="installed by `make venv` (the mlflow extra)")


def wandb_history(run_file, key: str) -> list[float]:
    """Values logged under `key`, read from wandb's offline record file (protobuf: field 2 the key, field 16
    its value as JSON; a step's history appears in more than one record, so compare as sets)."""
    data = run_file.read_bytes()
    pattern = rb"\x12" + bytes([len(key)]) + re.escape(key.encode()) + rb"\x82\x01(.)"
    out = []
    for m in re.finditer(pattern, data, re.S):
        n = m.group(1)[0]
        out.append(float(json.loads(data[m.end() : m.end() + n])))
    return out


def test_wandb_and_mlflow_through_train(ray_cluster, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    argv = [
        "train", "algorithm.name=grpo", f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic",
        "data.dataset_kwargs={num_samples: 16, val_size: 4, max_operand: 9}", "data.max_prompt_length=16",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2", "rollout.response_length=4",
        "reward.num_workers=0", "resources.device=cpu", "trainer.total_steps=2", f"trainer.output_dir={tmp_path}",
        "trainer.experiment_name=tracked", "trainer.project_name=proj", "trainer.loggers=[jsonl, wandb, mlflow]",
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    run = tmp_path / "tracked"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 2

    # wandb: offline files under WANDB_DIR, not the run directory
    (run_file,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb")
    assert not (run / "wandb").exists()
    times = [r["timing_s/step"] for r in rows if "timing_s/step" in r]  # distinct floats, one per step
    assert len(set(times)) == 2 and set(wandb_history(run_file, "timing_s/step")) == set(times)
    assert set(wandb_history(run_file, "reward/mean")) == set(rewards)

    # MLflow: sqlite store inside the run directory, metrics per step, params, the generations table
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run / 'mlflow' / 'mlflow.db'}")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    history = client.get_metric_history(mlrun.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [
        (1, pytest.approx(rewards[0])),
        (2, pytest.approx(rewards[1])),
    ]
    acc = client.get_metric_history(mlrun.info.run_id, "val/synthetic_arithmetic/acc_1")
    assert [m.step for m in acc] == [0, 2]  # MLflow names allow neither ":" nor "@"
    assert mlrun.data.params["algorithm.name"] == "grpo" and mlrun.info.status == "FINISHED"
    artifacts = [a.path for a in client.list_artifacts(mlrun.info.run_id, "val/generations")]
    assert "val/generations/step_0.json" in artifacts
