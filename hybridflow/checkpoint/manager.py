"""Checkpoint directories of a run: atomic commit, a `latest` pointer, keep-last-K pruning, resume.

Layout (root = the run directory):

    root/checkpoints/step_{N}/manifest.json      step, time, version, config hash, parts (files + sizes)
                             actor/ critic/ ...  written by the role workers (engine_state.py)
                             trainer_state.json  written by the driver (trainer_state.py)
    root/checkpoints/latest                      "step_{N}": the last committed checkpoint

Atomicity: writers fill a hidden temp directory in the same parent (`.tmp-step_N-...`); `commit`
fsyncs every file and directory, writes the manifest last, and renames the temp directory to
`step_N` (a rename inside one filesystem is atomic). A crash at any point leaves either the old
state or the complete new checkpoint visible, never half of one; leftovers are hidden and removed by
the next `begin`. Deletions (pruning, replacing a step) rename first and delete after, for the same
reason. The `latest` pointer is replaced atomically (tmp file + os.replace) after the rename; it is
the source of truth for `resume=auto` (a crash between the two resumes from the previous, still
complete checkpoint). Only one process (the driver) commits in a run directory; workers on other
nodes write into the temp directory through a shared filesystem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import hybridflow

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not hold what the caller needs."""


# ---- filesystem helpers ------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory fsync makes the names inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, under root (files may come from other processes:
    fsync flushes the inode whoever wrote it)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def atomic_write_text(path: Path, text: str) -> None:
    """Write text so readers see the old or the new content, never a prefix: tmp file, fsync, os.replace."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def _remove_dir(path: Path) -> None:
    """Delete a directory so that it never appears half-deleted under its own name."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_path(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def config_hash(config) -> str:
    """sha256 (first 16 hex digits) of a config (dataclass tree, dict, or anything JSON can render)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _list_files(part: Path) -> dict[str, int]:
    if part.is_file():
        return {"": part.stat().st_size}
    return {str(p.relative_to(part)): p.stat().st_size for p in sorted(part.rglob("*")) if p.is_file()}


# ---- the manager -------------------------------------------------------------------------------------
class CheckpointManager:
    """Checkpoints of one run under `root/checkpoints/`.

    root: the run directory (`cfg.run_dir`). keep_last: complete checkpoints to keep (<= 0 keeps all).
    config: the run's config (dataclass or dict); its hash goes into each manifest and a mismatch on
    load is logged (resuming with changed settings is allowed but worth a warning).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2, config=None):
        self.root = Path(root)
        self.dir = self.root / "checkpoints"
        self.keep_last = keep_last
        self.config_hash = config_hash(config) if config is not None else None

    # ---- naming and discovery --------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.dir / f"step_{int(step)}"

    def steps(self) -> list[int]:
        """Steps of the complete (manifest-bearing) checkpoints, ascending."""
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / MANIFEST).is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        """The step the `latest` pointer names if that checkpoint is complete; else the newest complete one
        (pointer lost or stale); None when there is none."""
        pointer = self.dir / LATEST
        if pointer.is_file():
            m = _STEP_RE.match(pointer.read_text().strip())
            if m and (self.dir / m.group(0) / MANIFEST).is_file():
                return int(m.group(1))
            log.warning(
                "checkpoint pointer %s is stale (%r); using the newest complete checkpoint",
                pointer,
                pointer.read_text().strip(),
            )
        steps = self.steps()
        return steps[-1] if steps else None

    def latest(self) -> Path | None:
        step = self.latest_step()
        return None if step is None else self.step_dir(step)

    def resolve(self, resume: str | os.PathLike | None) -> Path | None:
        """The checkpoint to resume from: `trainer.resume` = "auto" (latest, or None on a fresh run),
        "never"/"" (None), a step number ("12" or "step_12"), or a path to a step directory or to a run
        directory (its latest). Explicit choices that do not exist raise CheckpointError."""
        if resume is None or str(resume).strip().lower() in ("never", "", "none", "false"):
            return None
        text = str(resume).strip()
        if text.lower() == "auto":
            return self.latest()
        m = re.fullmatch(r"(?:step_)?(\d+)", text)
        try:
            path = self.step_dir(int(m.group(1))) if m and not Path(text).exists() else find_checkpoint(text)
            self.validate(path)
        except CheckpointError as e:
            raise CheckpointError(f"trainer.resume={text!r}: {e} ({self._available()})") from e
        return path

    def _available(self) -> str:
        steps = self.steps()
        return f"available steps in {self.dir}: {steps}" if steps else f"no checkpoints in {self.dir}"

    # ---- writing ---------------------------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """A fresh hidden temp directory to write checkpoint `step` into (stale temp dirs are removed)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.iterdir():
            if p.name.startswith((".tmp-", ".trash-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
        tmp = self.dir / f".tmp-step_{int(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def commit(self, step: int, tmp: Path, meta: dict | None = None) -> Path:
        """Make the temp directory checkpoint `step`: manifest, fsync, rename, pointer, prune."""
        tmp = Path(tmp)
        parts = {p.name: _list_files(p) for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
        if not parts:
            raise CheckpointError(f"nothing was written into {tmp}; refusing to commit an empty checkpoint")
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "unix_time": time.time(),
            "hybridflow_version": hybridflow.__version__,
            "config_hash": self.config_hash,
            "parts": {name: {"files": files, "bytes": sum(files.values())} for name, files in parts.items()},
            "meta": meta or {},
        }
        fsync_tree(tmp)
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))  # last: marks completeness
        final = self.step_dir(step)
        if final.exists():  # re-saving a step (e.g. after resuming from an earlier one)
            _remove_dir(final)
        os.rename(tmp, final)
        fsync_path(self.dir)
        atomic_write_text(self.dir / LATEST, f"{final.name}\n")
        self.prune()
        return final

    @contextlib.contextmanager
    def writing(self, step: int, meta: dict | None = None) -> Iterator[Path]:
        """`with manager.writing(step) as tmp:` write parts into tmp; committed on exit, discarded
        (previous checkpoints and `latest` untouched) if the block raises."""
        tmp = self.begin(step)
        try:
            yield tmp
        except BaseException:
            self.abort(tmp)
            raise
        self.commit(step, tmp, meta)

    def prune(self) -> list[int]:
        """Delete all but the newest `keep_last` complete checkpoints (never the one `latest` names)."""
        if self.keep_last <= 0:
            return []
        steps, keep = self.steps(), self.latest_step()
        doomed = [s for s in steps[: -self.keep_last] if s != keep]
        for s in doomed:
            _remove_dir(self.step_dir(s))
        return doomed

    # ---- reading ---------------------------------------------------------------------------------
    def validate(self, path: str | os.PathLike, require: Sequence[str] = ()) -> dict:
        """Check a checkpoint directory against its manifest; returns the manifest.

        require: part names the caller needs ("actor", "critic", "trainer_state.json"); a missing one
        is named in the error. Files listed in the manifest must exist with their recorded sizes.
        """
        manifest = read_manifest(path, require)
        if self.config_hash and manifest.get("config_hash") and manifest["config_hash"] != self.config_hash:
            log.warning(
                "resuming from %s, written with a different config (hash %s, now %s)",
                path,
                manifest["config_hash"],
                self.config_hash,
            )
        return manifest


def read_manifest(path: str | os.PathLike, require: Sequence[str] = ()) -> dict:
    """Load and verify `path/manifest.json` (see CheckpointManager.validate)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MANIFEST}); it may be from a crashed write. "
            "Resume from another step or use resume=auto"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath} is not valid JSON: {e}") from e
    parts = manifest.get("parts", {})
    for name in require:
        if name not in parts:
            raise CheckpointError(
                f"checkpoint {path} has no '{name}' part (it holds {sorted(parts)}); "
                f"was the {name} saved at step {manifest.get('step')}?"
            )
    for name, info in parts.items():
        for rel, size in info["files"].items():
            f = path / name / rel if rel else path / name
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path}: part '{name}' is missing file {f}")
            if f.stat().st_size != size:
                raise CheckpointError(
                    f"checkpoint {path}: part '{name}' file {f} has {f.stat().st_size} bytes, manifest says {size}"
                )
    return manifest


def find_checkpoint(source: str | os.PathLike, step: int | None = None) -> Path:
    """A step directory from a step directory, a `checkpoints/` directory or a run directory
    (`step` picks one; default: the latest)."""
    path = Path(source)
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; pass a run directory or a checkpoints/step_N directory"
        )
    if (path / MANIFEST).is_file() or _STEP_RE.match(path.name):
        if step is not None and path.name != f"step_{step}":
            raise CheckpointError(f"{path} is a checkpoint of another step than the requested step {step}")
        return path
    root = path.parent if path.name == "checkpoints" else path
    manager = CheckpointManager(root)
    if not manager.dir.is_dir():
        raise CheckpointError(f"{path} holds no checkpoints/ directory; is it a hybridflow run directory?")
    if step is not None:
        if step not in manager.steps():
            raise CheckpointError(f"no complete checkpoint for step {step}; {manager._available()}")
        return manager.step_dir(step)
    latest = manager.latest()
    if latest is None:
        raise CheckpointError(f"no complete checkpoint under {manager.dir}")
    return latest
