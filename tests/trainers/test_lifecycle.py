"""A run's life with real processes (docs/operations.md): `hybridflow train` as a child process with its
own embedded Ray cluster, a worker killed by pid, SIGTERM in the middle of a save, three rapid Ctrl-Cs
to the process group, a second run on the same directory, a finished run started again, and bad
resume settings. Afterwards no process the run started is alive (checked by pid) and none listens."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from hybridflow.checkpoint import CheckpointManager, read_manifest
from hybridflow.cli import main as cli_main
from hybridflow.config import load_config
from hybridflow.trainers import build_trainer
from hybridflow.trainers.lifecycle import Abandoned, StopSignals, stop_requested
from tests.trainers.lifecycle_helpers import (
    alive,
    comparable,
    descendants,
    grpo_config,
    listening,
    metric_rows,
    start_train,
    wait_for,
    worker_pids,
)


@pytest.fixture
def config_file(tiny_model_dir, tmp_path):
    return grpo_config(tmp_path, tiny_model_dir)


def _lines(log: Path) -> list[str]:
    return [x for x in log.read_text().splitlines() if x.startswith("hybridflow train:")]


def _assert_gone(tree: set[int], ports: dict) -> None:
    """Every process of the run has exited and nothing of it listens (ports were seen on 127.0.0.1)."""
    assert ports and all(
        a.rsplit(":", 1)[0] in ("127.0.0.1", "[::ffff:127.0.0.1]") for v in ports.values() for a in v
    )
    deadline = time.monotonic() + 10
    while alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(tree) == [], alive(tree)
    assert listening(tree) == {}


def test_dead_worker_restarts_from_last_checkpoint(ray_cluster, config_file, tmp_path, capsys):
    run = tmp_path / "run"
    first = start_train(config_file, log=tmp_path / "first.log")
    wait_for(lambda: any(r["step"] == 2 for r in metric_rows(run)), first, poll=0.01)
    # kill the worker during step 3 (step 2's checkpoint is written before its metrics row; on a loaded
    # machine the kill may land a little later: the restart must go back to the last checkpoint before it)
    tree = descendants(first.pid) | {first.pid}
    ports = listening(tree)
    (worker,) = worker_pids(first.pid)
    os.kill(worker, signal.SIGKILL)
    assert first.wait(timeout=600) == 0
    log = (tmp_path / "first.log").read_text()
    failed, resumed = (
        int(re.search(p, log).group(1)) for p in (r"restart 1/3 at step (\d+)", r"resumed from step (\d+)")
    )
    assert failed >= 3 and resumed == (failed - 1) // 2 * 2 and "restart 2/3" not in log
    rows = metric_rows(run)
    assert [r["step"] for r in rows] == list(range(9))
    assert [r["trainer/restarts"] for r in rows[1:]] == [0] * resumed + [1] * (8 - resumed)
    _assert_gone(tree | descendants(first.pid), ports)

    # the same config in one uninterrupted run: equal numbers at every step
    cfg = load_config(config_file, ["trainer.experiment_name=whole", "trainer.loggers=[jsonl]"])
    with build_trainer(cfg) as trainer:
        whole = trainer.fit()
    assert [comparable(r) for r in rows] == [comparable(r) for r in whole]

    # started again: finished, says so, trains nothing, exit 0
    capsys.readouterr()
    assert cli_main(["train", str(config_file)]) == 0
    assert "is finished: its checkpoint step_8 reached trainer.total_steps=8" in capsys.readouterr().out
    assert len(metric_rows(run)) == 9
    # resuming it with another batch size or another model: one line, exit 2, nothing touched
    other = tmp_path / "other_model"
    other.mkdir()
    cfg_json = (Path(cfg.model.path) / "config.json").read_text()
    (other / "config.json").write_text(cfg_json.replace('"hidden_size": ', '"hidden_size": 1'))
    for override, expected in [
        ("data.train_batch_size=8", "written with data.train_batch_size=4, this run has 8"),
        (f"model.path={other} model.tokenizer_path={cfg.model.path}", "differs (hidden_size"),
    ]:
        assert cli_main(["train", str(config_file), *override.split(), "trainer.total_steps=10"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expected in err and "trainer.resume=never" in err, err
    assert len(metric_rows(run)) == 9


def test_second_run_refused_sigterm_mid_save_then_three_sigints(config_file, tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    settings = ("trainer.total_steps=400", "trainer.save_every=1")
    proc = start_train(config_file, *settings, log=tmp_path / "a.log")
    # a second run on the same directory refuses in one line naming the holder; the first goes on
    wait_for(lambda: (run / ".lock").is_file() and f'"pid": {proc.pid},' in (run / ".lock").read_text(), proc)
    second = start_train(config_file, *settings, log=tmp_path / "second.log")
    assert second.wait(timeout=300) == 2
    (line,) = _lines(tmp_path / "second.log")
    assert f"in use by pid {proc.pid} on host" in line
    assert "Traceback" not in (tmp_path / "second.log").read_text()

    def saving():  # a temp dir of a step after the current one being written
        found = [p.name for p in ckpts.glob(".tmp-step_*")] if ckpts.is_dir() else []
        steps = [int(re.match(r"\.tmp-step_(\d+)", n).group(1)) for n in found]
        return max(steps) if steps and max(steps) > after else None

    after = max([r["step"] for r in metric_rows(run)], default=0) + 1
    step = wait_for(saving, proc, poll=0.005)
    tree = descendants(proc.pid) | {proc.pid}
    ports = listening(tree)
    proc.send_signal(signal.SIGTERM)  # mid-save: the save completes, then the run stops
    assert proc.wait(timeout=300) == 143
    last = _lines(tmp_path / "a.log")[-1]
    latest = CheckpointManager(run).latest()
    # On a loaded machine the save seen in flight may finish before the signal lands; the run then
    # finishes the step it is in and saves that one: stopped at `step` or the one after, never later.
    stopped = int(latest.name.removeprefix("step_"))
    assert stopped in (step, step + 1), (stopped, step)
    step = stopped
    assert f"stopped by SIGTERM after step {step}; checkpoint {latest}" == last.removeprefix(
        "hybridflow train: "
    )
    read_manifest(latest, require=["actor", "trainer_state.json"])  # complete, every SHA-256 matches
    assert [r["step"] for r in metric_rows(run)] == list(range(step + 1))  # one writer: no step twice
    assert "Traceback" not in (tmp_path / "a.log").read_text()
    _assert_gone(tree, ports)

    # resume it, then three Ctrl-Cs to the process group (as a terminal sends them) in quick succession
    proc = start_train(config_file, *settings, log=tmp_path / "b.log")
    wait_for(lambda: any(r["step"] == step + 1 for r in metric_rows(run)), proc)
    tree = descendants(proc.pid) | {proc.pid}
    ports = listening(tree)
    for _ in range(3):
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    assert proc.wait(timeout=300) == 130
    text = (tmp_path / "b.log").read_text()
    assert f"resumed from step {step}" in text and "Traceback" not in text
    assert "SIGINT" in _lines(tmp_path / "b.log")[-1]
    read_manifest(CheckpointManager(run).latest(), require=["actor", "trainer_state.json"])
    _assert_gone(tree, ports)


def test_bad_run_settings_fail_in_one_line(config_file, capsys):
    for override, expected in [
        ("trainer.experiment_name=../../x", "must be a relative name inside trainer.output_dir"),
        ("trainer.resume=7", "trainer.resume='7': checkpoint"),
    ]:
        assert cli_main(["train", str(config_file), override]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expected in err, err


def test_checkpoints_by_time(ray_cluster, make_config):
    """trainer.save_every_minutes saves after the first step that ends that long after the last save
    (save_every=0: without it only the last step would be saved)."""
    cfg = make_config("grpo", "trainer.total_steps=3", "trainer.save_every=0", "trainer.keep_last=5",
                      "trainer.save_every_minutes=1e-6", "trainer.val_before_train=false")  # fmt: skip
    with build_trainer(cfg) as trainer:
        trainer.fit()
    assert CheckpointManager(cfg.run_dir).steps() == [1, 2, 3]


def test_stop_signals_grace_second_signal_and_shield():
    """The first signal only asks; a second one, or trainer.stop_grace_s passing, abandons; after
    shield() (the CLI's cleanup) nothing interrupts. In-process, no Ray."""
    with StopSignals(grace_s=0.3) as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested() == signal.SIGTERM
        with pytest.raises(Abandoned, match=r"trainer.stop_grace_s=0.3 passed after SIGTERM: the step"):
            time.sleep(5)  # a step that overruns the grace period
    assert stop_requested() is None
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(Abandoned, match="SIGINT again"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        signals.shield()
        os.kill(os.getpid(), signal.SIGINT)  # ignored during cleanup
        time.sleep(0.1)
