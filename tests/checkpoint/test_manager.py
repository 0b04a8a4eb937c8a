"""CheckpointManager: atomic commit under a simulated crash, keep-last-K, the `latest` pointer, resume
resolution and manifest validation; trainer state and RNG round trips. No model involved."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import subprocess

import numpy as np
import pytest
import torch

from hybridflow.checkpoint import (
    CheckpointDiskFull,
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    load_trainer_state,
    read_manifest,
    restore_rng_state,
    save_trainer_state,
)
from hybridflow.checkpoint.fsutil import owner_tag


def _save(manager: CheckpointManager, step: int, payload: str = "x") -> None:
    with manager.writing(step, meta={"note": payload}) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "weights.bin").write_text(payload * step)
        save_trainer_state(tmp, {"step": step})


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _visible(manager: CheckpointManager) -> list[str]:
    return sorted(p.name for p in manager.dir.iterdir())


def test_crash_inside_writer_keeps_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    _save(manager, 1)
    with pytest.raises(RuntimeError, match="worker died"):
        with manager.writing(2) as tmp:
            (tmp / "actor").mkdir()
            (tmp / "actor" / "weights.bin").write_text("half")
            raise RuntimeError("worker died mid-save")
    assert _visible(manager) == ["latest", "step_1"]  # no step_2, no temp dir left behind
    assert (manager.dir / "latest").read_text().strip() == "step_1"
    assert manager.latest_step() == 1 and manager.resolve("auto") == manager.step_dir(1)

    # A hard crash (no cleanup at all): the half-written temp dir stays hidden and is swept by begin()
    # once its owner (host~pid in the name) is dead; a live owner's temp dir is left alone.
    live = manager.begin(2)
    (live / "trainer_state.json").write_text('{"step": 2')
    dead_pid = _dead_pid()
    dead = live.with_name(live.name.replace(f"~{os.getpid()}-", f"~{dead_pid}-"))
    shutil.copytree(live, dead)
    assert manager.steps() == [1] and manager.latest_step() == 1
    _save(manager, 2)
    assert _visible(manager) == [live.name, "latest", "step_1", "step_2"]  # only the dead one swept
    shutil.rmtree(live)
    assert load_trainer_state(manager.resolve("auto")) == {"step": 2}


def test_incomplete_step_dir_is_ignored_and_refused(tmp_path):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    (manager.dir / "step_9").mkdir()  # e.g. copied by hand, no manifest
    assert manager.steps() == [1] and manager.latest_step() == 1
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.resolve(str(manager.dir / "step_9"))


def test_a_step_replaced_by_a_file_is_replaced_without_trash_left(tmp_path):
    """Re-saving a step whose directory was replaced by a file (rmtree alone left it as .trash-step_1-*),
    and a dead writer's trash file, swept by the next save."""
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    shutil.rmtree(manager.step_dir(1))
    manager.step_dir(1).write_text("not a checkpoint")
    _save(manager, 1)
    assert _visible(manager) == ["latest", "step_1"]
    host = owner_tag().split("~")[0]
    (manager.dir / f".trash-step_0-{host}~{_dead_pid()}-0123abcd").write_text("left by a dead writer")
    _save(manager, 2)
    assert _visible(manager) == ["latest", "step_1", "step_2"]


def test_keep_last_k_and_pointer(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        _save(manager, step)
    assert _visible(manager) == ["latest", "step_4", "step_5"]
    keep_all = CheckpointManager(tmp_path / "all", keep_last=0)
    for step in (10, 20, 30):
        _save(keep_all, step)
    assert keep_all.steps() == [10, 20, 30]
    # Re-saving an existing step (resumed from an earlier one) replaces it whole.
    _save(keep_all, 20, payload="y")
    assert (keep_all.step_dir(20) / "actor" / "weights.bin").read_text() == "y" * 20
    assert keep_all.latest_step() == 20  # the last committed, not the largest number


def test_resolve_auto_never_step_and_paths(tmp_path):
    manager = CheckpointManager(tmp_path / "run", keep_last=0)
    assert manager.resolve("auto") is None and manager.latest_step() is None  # fresh run
    for step in (1, 2, 3):
        _save(manager, step)
    assert manager.resolve("auto") == manager.step_dir(3)
    assert manager.resolve("never") is None and manager.resolve(None) is None
    assert manager.resolve("2") == manager.resolve("step_2") == manager.step_dir(2)
    assert manager.resolve(str(manager.step_dir(1))) == manager.step_dir(1)
    assert manager.resolve(str(tmp_path / "run")) == manager.step_dir(3)  # a run dir: its latest
    (manager.dir / "latest").unlink()  # pointer lost: the newest complete checkpoint
    assert manager.resolve("auto") == manager.step_dir(3)
    (manager.dir / "latest").write_text("step_77\n")  # stale pointer
    assert manager.latest_step() == 3
    with pytest.raises(CheckpointError, match=r"does not exist.*available steps in .*\[1, 2, 3\]"):
        manager.resolve(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointError, match=r"trainer.resume='8'.*\[1, 2, 3\]"):
        manager.resolve("8")


def test_manifest_records_parts_and_validation_names_what_is_missing(tmp_path):
    manager = CheckpointManager(tmp_path, config={"lr": 1e-5, "n": 4})
    _save(manager, 3)
    step_dir = manager.step_dir(3)
    m = manager.validate(step_dir, require=["actor", "trainer_state.json"])
    assert m["step"] == 3 and m["meta"] == {"note": "x"} and m["hybridflow_version"]
    assert m["config_hash"] == CheckpointManager(tmp_path, config={"n": 4, "lr": 1e-5}).config_hash
    assert m["config_hash"] != CheckpointManager(tmp_path, config={"n": 5, "lr": 1e-5}).config_hash
    assert m["parts"]["actor"]["files"] == {"weights.bin": 3}
    with pytest.raises(CheckpointError, match="no 'critic' part"):
        manager.validate(step_dir, require=["critic"])
    (step_dir / "actor" / "weights.bin").write_text("x")  # truncated
    with pytest.raises(CheckpointError, match="weights.bin has 1 bytes, manifest says 3"):
        read_manifest(step_dir)
    (step_dir / "actor" / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match="part 'actor' is missing file"):
        read_manifest(step_dir)
    with pytest.raises(CheckpointError, match="empty checkpoint"):
        with manager.writing(4):
            pass


def test_trainer_state_round_trip_is_exact(tmp_path):
    state = {
        "step": 7,
        "dataloader": {"epoch": 1, "position": 24, "seed": 3},
        "kl_coef": 0.1 + 0.2,  # not representable exactly: must come back bit-identical
        "lagrange": np.float32(0.25),
        "history": torch.tensor([1.5, -2.0]),
        "rng": capture_rng_state(),
    }
    save_trainer_state(tmp_path, state)
    back = load_trainer_state(tmp_path)
    assert back["kl_coef"] == 0.1 + 0.2 and back["lagrange"] == 0.25 and back["history"] == [1.5, -2.0]
    assert back["dataloader"] == state["dataloader"]
    with pytest.raises(TypeError, match="object is not JSON-serialisable"):
        save_trainer_state(tmp_path, {"bad": object()})
    with pytest.raises(CheckpointError, match="no trainer_state.json"):
        load_trainer_state(tmp_path / "elsewhere")


def _draws():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.randn(1).tolist(),
        torch.rand(3).tolist(),
        torch.randint(0, 1000, (4,)).tolist(),
    )


def test_rng_restore_reproduces_draws():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    state = json.loads(json.dumps(capture_rng_state()))  # survives JSON
    first = _draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    assert _draws() != first
    restore_rng_state(state)
    assert _draws() == first
    with pytest.raises(ValueError, match="lacks"):
        restore_rng_state({"python": state["python"]})


def test_sha256_checked_before_load_and_previous_valid_checkpoint_named(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (1, 2):
        _save(manager, step, payload="ab")
    weights = manager.step_dir(2) / "actor" / "weights.bin"
    digest = read_manifest(manager.step_dir(2))["parts"]["actor"]["sha256"]["weights.bin"]
    assert digest == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert manager.resolve("2") == manager.resolve("step_2") == manager.step_dir(2)  # a step number
    weights.write_text("ba" * 2)  # same size, other bytes: only the digest can tell
    with pytest.raises(CheckpointError) as e:
        manager.resolve("2")
    msg = str(e.value)
    assert "\n" not in msg and str(weights) in msg and "SHA-256" in msg
    assert f"previous valid checkpoint: {manager.step_dir(1)} (trainer.resume=1)" in msg
    assert manager.resolve("auto") == manager.step_dir(1)  # auto skips the damaged one, and says so
    assert "skipping damaged checkpoint" in caplog.text
    (manager.step_dir(1) / "trainer_state.json").write_text('{"step": 9}')
    with pytest.raises(CheckpointError, match="no earlier valid checkpoint"):
        manager.resolve("auto")


def test_corrupt_latest_pointer_falls_back_to_newest_complete(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    _save(manager, 1)
    (manager.dir / "latest").write_bytes(b"\xff\xfe\x00garbage")
    assert manager.latest_step() == 1 and "stale or corrupt" in caplog.text


def test_checkpoint_without_manifest_is_invalid_and_auto_never_starts_over(tmp_path, caplog):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in (2, 4):
        _save(manager, step)
    (manager.step_dir(4) / "manifest.json").unlink()  # the newest one: skipped like a damaged one
    assert manager.resolve("auto") == manager.step_dir(2) and "stale or corrupt ('step_4')" in caplog.text
    (manager.step_dir(2) / "manifest.json").unlink()  # none left that verifies: refused, not a fresh start
    with pytest.raises(CheckpointError) as e:
        manager.resolve("auto")
    msg = str(e.value)
    assert "\n" not in msg and "no valid checkpoint" in msg and "trainer.resume=never" in msg
    assert "step_2 has no manifest.json; step_4 has no manifest.json" in msg
    shutil.rmtree(manager.step_dir(2))
    shutil.rmtree(manager.step_dir(4))  # only the pointer is left: a run was here all the same
    with pytest.raises(CheckpointError, match="latest names 'step_4', not a complete checkpoint"):
        manager.resolve("auto")
    assert manager.resolve("never") is None


def _assert_disk_full_kept_step_1(manager: CheckpointManager, info) -> None:
    line = str(info.value)
    assert "\n" not in line and line.startswith(
        f"checkpoint of step 2 not saved: no space left on device in {manager.dir} ("
    )
    assert line.endswith("MiB free); it was discarded and step_1 and `latest` are intact; free space (or "
                         "lower trainer.keep_last) and resume")  # fmt: skip
    assert _visible(manager) == ["latest", "step_1"]  # no temp directory left behind
    assert manager.resolve("auto") == manager.step_dir(1)
    assert (manager.step_dir(1) / "actor" / "weights.bin").read_text() == "x"


def test_disk_full_while_a_part_is_written_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    _save(manager, 1)
    with pytest.raises(CheckpointDiskFull) as info:
        with manager.writing(2) as tmp:
            (tmp / "actor").mkdir()
            (tmp / "actor" / "weights.bin").write_text("partial")
            raise OSError(errno.ENOSPC, "No space left on device")  # what a full disk's write raises
    _assert_disk_full_kept_step_1(manager, info)


def test_disk_full_while_the_manifest_is_written_is_one_line_too(tmp_path, monkeypatch):
    import hybridflow.checkpoint.manager as manager_module

    manager = CheckpointManager(tmp_path / "ckpt")
    _save(manager, 1)

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manager_module, "atomic_write_text", full)
    with pytest.raises(CheckpointDiskFull) as info:
        _save(manager, 2)
    monkeypatch.undo()
    _assert_disk_full_kept_step_1(manager, info)


def test_a_worker_s_disk_full_error_as_ray_renders_it_is_recognised(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    _save(manager, 1)
    with pytest.raises(CheckpointDiskFull) as info:
        with manager.writing(2):
            raise RuntimeError(
                "ray::Worker.save_checkpoint() ...\nOSError: [Errno 28] No space left on device"
            )
    _assert_disk_full_kept_step_1(manager, info)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_disk_full_on_a_real_1_mib_tmpfs(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        manager = CheckpointManager(disk / "ckpt")
        _save(manager, 1)
        with pytest.raises(CheckpointDiskFull) as info:
            with manager.writing(2) as tmp:
                (tmp / "actor").mkdir()
                (tmp / "actor" / "weights.bin").write_bytes(b"\0" * (2 << 20))  # 2 MiB > the 1 MiB disk
        _assert_disk_full_kept_step_1(manager, info)
    finally:
        subprocess.run(["umount", str(disk)])
