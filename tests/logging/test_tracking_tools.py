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


# A run's end as `hybridflow train` has it: the backend closed, then the process's children (wandb's
# service among them) killed by the run's cleanup before the interpreter exits.
_CLOSE_THEN_EXIT = """
import os, signal, sys
from hybridflow.logging.backends import WandbBackend
backend = WandbBackend(sys.argv[1], "proj", "run", {"a": 1})
backend.log({"x": 1.0}, 1)
backend.close()
for stat in os.listdir("/proc"):
    try:
        with open(f"/proc/{stat}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        continue
    if ppid == os.getpid():
        os.kill(int(stat), signal.SIGKILL)
"""


def test_wandb_without_an_api_key_logs_offline_and_exits_quietly(tmp_path, monkeypatch):
    """No key (no WANDB_API_KEY, no netrc entry) and no WANDB_MODE: one warning line and an offline run,
    not wandb's UsageError; and after close() no atexit teardown of wandb's is left to find its service
    process gone (a ConnectionResetError traceback after every run's last line)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from hybridflow.logging.backends import wandb_has_no_key

    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(NETRC=str(tmp_path / "netrc"), WANDB_CONFIG_DIR=str(tmp_path / "config"), WANDB_SILENT="true")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith("WANDB_") and k not in env]:
        monkeypatch.delenv(key)
    assert wandb_has_no_key()
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai login user password {'k' * 40}\n")
    assert not wandb_has_no_key()  # what `wandb login` writes
    (tmp_path / "netrc").unlink()

    out = subprocess.run([sys.executable, "-c", _CLOSE_THEN_EXIT, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trainer.loggers has wandb but no API key is set here" in out.stderr
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr[-2000:]
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
