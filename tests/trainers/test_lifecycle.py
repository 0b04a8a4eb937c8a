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

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run alone, after the parallel part (Makefile)


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

    # its final checkpoint resumed by name: finished, says so, trains nothing, exit 0
    capsys.readouterr()
    assert cli_main(["train", str(config_file), "trainer.resume=8"]) == 0
    assert "is finished: its checkpoint step_8 reached trainer.total_steps=8" in capsys.readouterr().out
    assert len(metric_rows(run)) == 9
    # resuming it by name with another batch size or another model: one line, exit 2, nothing touched
    # (trainer.resume=auto would leave it alone and start run-2: tests/test_api.py)
    from hybridflow.models.tiny import save_tiny_model

    other = save_tiny_model(tmp_path / "other_model", hidden_size=80)  # a whole model, 80 wide, not 64
    capsys.readouterr()  # its progress bar
    for override, expected in [
        ("data.train_batch_size=8", "written with data.train_batch_size=4, this run has 8"),
        (f"model.path={other} model.tokenizer_path={cfg.model.path}", "step_8's (hidden_size"),
    ]:
        overrides = [*override.split(), "trainer.total_steps=10", "trainer.resume=8"]
        assert cli_main(["train", str(config_file), *overrides]) == 2
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
    start, line = _lines(tmp_path / "second.log")  # the start-up line, then the refusal
    assert start.startswith("hybridflow train: grpo on") and f"in use by pid {proc.pid} on host" in line
    assert "Traceback" not in (tmp_path / "second.log").read_text()

    def saving():  # a temp dir of a step after the current one being written
        found = [p.name for p in ckpts.glob(".tmp-step_*")] if ckpts.is_dir() else []
        steps = [int(re.match(r"\.tmp-step_(\d+)", n).group(1)) for n in found]
        return max(steps) if steps and max(steps) > after else None

    after = max([r["step"] for r in metric_rows(run)], default=0) + 1
    (worker,) = wait_for(lambda: worker_pids(proc.pid), proc)
    while True:  # freeze the worker with a save in flight (seen after the freeze: no race with it)
        step = wait_for(saving, proc, poll=0.005)
        os.kill(worker, signal.SIGSTOP)
        if list(ckpts.glob(f".tmp-step_{step}-*")):
            break
        os.kill(worker, signal.SIGCONT)  # that save was done already: the next one
        after = step
    tree = descendants(proc.pid) | {proc.pid}
    ports = listening(tree)
    proc.send_signal(signal.SIGTERM)  # mid-save: the save completes, then the run stops at once
    time.sleep(0.5)
    os.kill(worker, signal.SIGCONT)
    assert proc.wait(timeout=300) == 143
    last = _lines(tmp_path / "a.log")[-1]
    latest = CheckpointManager(run).latest()
    assert latest.name == f"step_{step}", (latest, step)
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


def _stop_hung_run(proc, log: Path, signals: int, limit_s: float) -> tuple[float, str]:
    """SIGSTOP the run's worker (hung, not dead), then send `signals` SIGTERMs to the trainer; -> the
    seconds from the first SIGTERM to its exit, and its last line. The worker is killed afterwards
    whatever happens (a stopped process would outlive a failed test)."""
    (worker,) = worker_pids(proc.pid)
    tree = descendants(proc.pid) | {proc.pid}
    ports = listening(tree)
    os.kill(worker, signal.SIGSTOP)
    # the driver reaches a call on the stopped worker (every step needs it, each a few tenths of a second
    # under load) and waits there
    time.sleep(1.5)
    try:
        start = time.monotonic()
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        rc = proc.wait(timeout=limit_s)
        elapsed = time.monotonic() - start
    finally:
        for p in alive(tree):
            os.kill(p, signal.SIGKILL)
    print(f"{log.name}: exit {rc} {elapsed:.1f} s after the first SIGTERM")
    assert rc == 143 and "Traceback" not in log.read_text()
    _assert_gone(tree, ports)
    return elapsed, _lines(log)[-1]


def test_hung_worker_never_makes_the_run_unstoppable(config_file, tmp_path):
    """A worker stopped (SIGSTOP) mid-run: the first SIGTERM ends the run once trainer.stop_grace_s has
    passed, naming the call it waited for; after a resume, a second SIGTERM ends it at once."""
    run = tmp_path / "run"
    settings = ("trainer.total_steps=400", "trainer.save_every=1")
    proc = start_train(config_file, *settings, "trainer.stop_grace_s=3", log=tmp_path / "a.log")
    wait_for(lambda: any(r["step"] == 2 for r in metric_rows(run)), proc)
    elapsed, last = _stop_hung_run(proc, tmp_path / "a.log", signals=1, limit_s=90)
    assert 3 <= elapsed < 60, elapsed  # the grace period, then the shutdown (kills the stopped worker)
    assert "trainer.stop_grace_s=3 passed after SIGTERM: the step and its checkpoint were abandoned " in last
    assert re.search(
        r"while waiting for actor_rollout\.\w+ \(ranks \[0\]\); latest checkpoint: .*step_", last
    )
    read_manifest(CheckpointManager(run).latest(), require=["actor", "trainer_state.json"])

    proc = start_train(config_file, *settings, log=tmp_path / "b.log")  # stop_grace_s=120
    step = CheckpointManager(run).latest_step()
    wait_for(lambda: any(r["step"] == step + 1 for r in metric_rows(run)), proc)
    elapsed, last = _stop_hung_run(proc, tmp_path / "b.log", signals=2, limit_s=90)
    assert elapsed < 60 and "SIGTERM again: the step and its checkpoint were abandoned while waiting" in last


def test_hung_worker_is_killed_and_restarted_after_hang_timeout(config_file, tmp_path):
    """trainer.hang_timeout_s: a worker stopped mid-run (alive, silent) is treated as dead: one line names
    group, rank and method, its process is killed, the run resumes from its last checkpoint and ends."""
    run = tmp_path / "run"
    # 8 s: several times the longest call of this one-rank tiny run under load (a save, a validation)
    settings = ("trainer.total_steps=6", "trainer.save_every=1", "trainer.hang_timeout_s=8")
    proc = start_train(config_file, *settings, log=tmp_path / "a.log")
    wait_for(lambda: any(r["step"] == 2 for r in metric_rows(run)), proc)
    (worker,) = worker_pids(proc.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        assert proc.wait(timeout=600) == 0
    finally:
        if alive([worker]):
            os.kill(worker, signal.SIGKILL)
    text = (tmp_path / "a.log").read_text()
    line = re.search(r"hybridflow train: restart 1/3 at step \d+: (.*)", text).group(1)
    assert re.fullmatch(
        r"worker group 'actor_rollout': rank 0 \(of waiting ranks \[0\]\) made no progress in '\w+' for 8 s "
        r"\(trainer.hang_timeout_s\); treated as dead",
        line,
    ), line
    assert "restart 2/3" not in text and "Traceback" not in text
    assert [r["step"] for r in metric_rows(run)] == list(range(7)) and alive([worker]) == []


def test_bad_run_settings_fail_in_one_line(config_file, capsys):
    for override, expected in [
        ("trainer.experiment_name=../../x", "must be a relative name inside trainer.output_dir"),
        ("trainer.resume=7", "trainer.resume='7': checkpoint"),
    ]:
        assert cli_main(["train", str(config_file), override]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expected in err, err


def test_run_without_a_valid_checkpoint_is_refused_not_started_over(config_file, tmp_path, capsys):
    """A run directory whose checkpoints lost their manifests: resume=auto stops in one line (exit 2)
    before Ray starts, and the run's metrics.jsonl is left as it was (no second history appended)."""
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step_4" / "actor").mkdir(parents=True)
    (ckpts / "latest").write_text("step_4\n")
    history = "".join(f'{{"step": {s}, "reward/mean": 0.5}}\n' for s in range(5))
    (tmp_path / "run" / "metrics.jsonl").write_text(history)
    assert cli_main(["train", str(config_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no valid checkpoint" in err and "step_4 has no manifest.json" in err, err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == history


def test_checkpoints_by_time(ray_cluster, make_config):
    """trainer.save_every_minutes saves after the first step that ends that long after the last save
    (save_every=0: without it only the last step would be saved)."""
    cfg = make_config("grpo", "trainer.total_steps=3", "trainer.save_every=0", "trainer.keep_last=5",
                      "trainer.save_every_minutes=1e-6", "trainer.val_before_train=false")  # fmt: skip
    with build_trainer(cfg) as trainer:
        trainer.fit()
    assert CheckpointManager(cfg.run_dir).steps() == [1, 2, 3]


def test_stop_signals_grace_second_signal_and_cleanup():
    """The first signal only asks; a second one, or trainer.stop_grace_s passing, abandons the run's body
    (running()); once the body has ended nothing interrupts the cleanup. In-process, no Ray."""
    with StopSignals(grace_s=0.3) as signals, signals.running():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop_requested() == signal.SIGTERM
        with pytest.raises(Abandoned, match=r"trainer.stop_grace_s=0.3 passed after SIGTERM: the step"):
            time.sleep(5)  # a step that overruns the grace period
    assert stop_requested() is None
    with StopSignals() as signals:
        with pytest.raises(Abandoned, match="SIGINT again"), signals.running():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        for _ in range(2):  # after the body (the CLI's shutdown): noted, never raised
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
    with StopSignals() as signals:
        with signals.running():
            os.kill(os.getpid(), signal.SIGTERM)  # asks; the body ends on its own (a step's end)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert signals.signum == signal.SIGTERM and not signals.abandoned
    with StopSignals(grace_s=0.2) as signals:
        with signals.running():
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the grace timer went with the body: no abandonment during the cleanup


def test_two_signals_during_one_c_call_still_abandon():
    """Two SIGTERMs that arrive while the main thread is inside one C call (as in a Ray wait, which checks
    for signals once a second) run the Python handler once; they still count as two and abandon."""
    import hashlib
    import threading

    inside = threading.Event()

    def send_two() -> None:
        inside.wait()
        time.sleep(0.02)
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)

    sender = threading.Thread(target=send_two)
    sender.start()
    calls = []
    with StopSignals() as signals:
        handle = signals._handle
        signals._handle = lambda *a: (calls.append(a[0]), handle(*a))
        signal.signal(signal.SIGTERM, signals._handle)
        with pytest.raises(Abandoned, match="SIGTERM again"), signals.running():
            inside.set()
            # ~1.4 s here of C with the GIL released and no signal check; the sender needs 0.03 s
            hashlib.pbkdf2_hmac("sha256", b"x", b"salt", 6_000_000)
    sender.join()
    assert calls == [signal.SIGTERM]  # one handler call for both deliveries: the case this guards
