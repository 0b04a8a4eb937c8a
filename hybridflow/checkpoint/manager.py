"""Checkpoint directories of a run: atomic commit, a `latest` pointer, keep-last-K pruning, resume.

Layout (root = the run directory):

    root/checkpoints/step_{N}/manifest.json      step, time, version, config hash, parts (files, sizes, SHA-256)
                             actor/ critic/ ...  written by the role workers (engine_state.py)
                             trainer_state.json  written by the driver (trainer_state.py)
    root/checkpoints/latest                      "step_{N}": the last committed checkpoint

Atomicity: writers fill a hidden temp directory in the same parent (`.tmp-step_N-...`); `commit`
fsyncs every file and directory, writes the manifest last, and renames the temp directory to
`step_N` (a rename inside one filesystem is atomic). A crash at any point leaves either the old
state or the complete new checkpoint visible, never half of one; leftovers are hidden and removed by
the next `begin` once their owner (pid and host in the name) is dead. Deletions (pruning, replacing a step) rename first and delete after, for the same
reason. The `latest` pointer is replaced atomically (tmp file + os.replace) after the rename; it is
the source of truth for `resume=auto` (a crash between the two resumes from the previous, still
complete checkpoint). Only one process (the driver) commits in a run directory (run_lock.py holds the
directory for it); workers on other nodes write into the temp directory through a shared filesystem.

Integrity: the manifest records the SHA-256 of every file; `validate` recomputes them before anything
is loaded, so a checkpoint file that was corrupted or replaced is refused with its name (and, for
`resume=auto`, the previous valid checkpoint is used instead, with a warning). See docs/operations.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import hybridflow
from hybridflow.checkpoint.fsutil import (  # noqa: F401 — re-exported for engine_state, export
    atomic_write_text,
    fsync_path,
    fsync_tree,
    owner_alive,
    owner_tag,
    sha256_file,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not hold what the caller needs."""


class CheckpointDiskFull(CheckpointError):
    """A save that ran out of disk space: discarded, the checkpoints before it intact (one line)."""


class CheckpointNotFinite(CheckpointError):
    """A save refused because a weight or optimizer moment is NaN/inf (engines/checkpoint_io.py): nothing
    committed, nothing pruned, the checkpoints before it intact (one line)."""


def _not_finite_detail(error: BaseException | None) -> str | None:
    """The writer's "<tensor> is not finite; refusing to save it", here or in a worker (Ray's `cause`)."""
    for _ in range(8):
        if error is None:
            return None
        for line in str(error).splitlines():
            if "is not finite; refusing to save it" in line:
                return line.split("Error: ", 1)[-1].strip()
        error = getattr(error, "cause", None) or error.__cause__
    return None


def _is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC/EDQUOT here or in a worker (Ray wraps a worker's exception and keeps it as `cause`)."""
    for _ in range(8):
        if error is None:
            return False
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(error):  # a worker's error as Ray renders it
            return True
        error = getattr(error, "cause", None) or error.__cause__
    return False


# ---- filesystem helpers (the rest in fsutil.py) -----------------------------------------------------
def _remove_dir(path: Path) -> None:
    """Delete a directory so that it never appears half-deleted under its own name. A file in its place
    (a step directory replaced by hand) is deleted too: rmtree would leave it as trash."""
    trash = path.with_name(f".trash-{path.name}-{owner_tag()}-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    fsync_path(path.parent)
    _remove_any(trash)


def _remove_any(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
            text = pointer.read_bytes()[:200].decode("utf-8", errors="replace").strip()
            m = _STEP_RE.match(text)
            if m and (self.dir / m.group(0) / MANIFEST).is_file():
                return int(m.group(1))
            log.warning(
                "checkpoint pointer %s is stale or corrupt (%r); using the newest complete checkpoint",
                pointer,
                text[:40],
            )
        steps = self.steps()
        return steps[-1] if steps else None

    def latest(self) -> Path | None:
        step = self.latest_step()
        return None if step is None else self.step_dir(step)

    def resolve(self, resume: str | os.PathLike | None, require: Sequence[str] = ()) -> Path | None:
        """The checkpoint to resume from, verified (sizes, SHA-256, `require`d parts): `trainer.resume` =
        "auto" (latest, or None on a fresh run; a damaged one is skipped for the newest valid earlier
        one, with a warning), "never"/"" (None), a step number ("12" or "step_12"), or a path to a step
        directory or to a run directory (its latest). Explicit choices that fail raise CheckpointError."""
        if resume is None or str(resume).strip().lower() in ("never", "", "none", "false"):
            return None
        text = str(resume).strip()
        if text.lower() == "auto":
            return self._latest_valid(require)
        m = re.fullmatch(r"(?:step_)?(\d+)", text)
        try:
            path = self.step_dir(int(m.group(1))) if m and not Path(text).exists() else find_checkpoint(text)
            self.validate(path, require)
        except CheckpointError as e:
            raise CheckpointError(f"trainer.resume={text!r}: {e} ({self._available()})") from e
        return path

    def incomplete(self) -> list[str]:
        """Traces of checkpoints that cannot be loaded: `step_N` directories without a manifest (commit
        renames a directory into place only after writing it, so one is damaged, not half-written) and
        a `latest` pointer naming no complete checkpoint."""
        if not self.dir.is_dir():
            return []
        found = [
            f"{p.name} has no {MANIFEST}"
            for p in sorted(self.dir.iterdir())
            if _STEP_RE.match(p.name) and not (p / MANIFEST).is_file()
        ]
        pointer = self.dir / LATEST
        if pointer.is_file():
            text = pointer.read_bytes()[:200].decode("utf-8", errors="replace").strip()
            if not (_STEP_RE.match(text) and (self.dir / text / MANIFEST).is_file()):
                found.append(f"{LATEST} names {text[:40]!r}, not a complete checkpoint")
        return found

    def _latest_valid(self, require: Sequence[str]) -> Path | None:
        latest = self.latest_step()
        if latest is None:
            if damage := self.incomplete():  # a run was here: starting over would discard it silently
                raise CheckpointError(
                    f"trainer.resume=auto: no valid checkpoint in {self.dir} ({'; '.join(damage)}); "
                    "resume from a checkpoint path, or start over with trainer.resume=never"
                )
            return None
        candidates = [latest] + [s for s in reversed(self.steps()) if s < latest]
        for i, step in enumerate(candidates):
            try:
                self.validate(self.step_dir(step), require)
            except CheckpointError as e:
                if i + 1 == len(candidates):
                    raise CheckpointError(f"trainer.resume=auto: {e}; no earlier valid checkpoint") from e
                log.warning("skipping damaged checkpoint: %s", e)
                continue
            if step != latest:
                log.warning("resuming from step_%d, the newest checkpoint that verifies", step)
            return self.step_dir(step)
        return None

    def _available(self) -> str:
        steps = self.steps()
        return f"available steps in {self.dir}: {steps}" if steps else f"no checkpoints in {self.dir}"

    # ---- writing ---------------------------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """A fresh hidden temp directory to write checkpoint `step` into (leftovers of dead writers are
        removed; a live writer's are left alone)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.iterdir():
            if p.name.startswith((".tmp-", ".trash-")) and not owner_alive(p.name):
                _remove_any(p)
        tmp = self.dir / f".tmp-step_{int(step)}-{owner_tag()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def abort(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    def commit(
        self, step: int, tmp: Path, meta: dict | None = None, before_commit: Callable[[], None] | None = None
    ) -> Path:
        """Make the temp directory checkpoint `step`: manifest, fsync, rename, pointer, prune.
        before_commit: called once all is written, right before the rename that makes the step resumable
        (the trainer writes the step's metrics row there: a crash on either side of it loses no row)."""
        tmp = Path(tmp)
        parts = {p.name: _list_files(p) for p in sorted(tmp.iterdir()) if p.name != MANIFEST}
        digests = {
            name: {rel: sha256_file(tmp / name / rel if rel else tmp / name) for rel in files}
            for name, files in parts.items()
        }
        if not parts:
            raise CheckpointError(f"nothing was written into {tmp}; refusing to commit an empty checkpoint")
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": int(step),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "unix_time": time.time(),
            "hybridflow_version": hybridflow.__version__,
            "config_hash": self.config_hash,
            "parts": {
                name: {"files": files, "bytes": sum(files.values()), "sha256": digests[name]}
                for name, files in parts.items()
            },
            "meta": meta or {},
        }
        fsync_tree(tmp)
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))  # last: marks completeness
        if before_commit is not None:
            before_commit()
        final = self.step_dir(step)
        if final.exists():  # re-saving a step (e.g. after resuming from an earlier one)
            _remove_dir(final)
        os.rename(tmp, final)
        fsync_path(self.dir)
        atomic_write_text(self.dir / LATEST, f"{final.name}\n")
        self.prune()
        return final

    @contextlib.contextmanager
    def writing(
        self, step: int, meta: dict | None = None, before_commit: Callable[[], None] | None = None
    ) -> Iterator[Path]:
        """`with manager.writing(step) as tmp:` write parts into tmp; committed on exit, discarded
        (previous checkpoints and `latest` untouched) if the block or `before_commit` raises."""
        tmp = None
        try:
            tmp = self.begin(step)
            yield tmp
            self.commit(step, tmp, meta, before_commit)
        except BaseException as e:
            if tmp is not None:
                self.abort(tmp)
            if _is_disk_full(e):
                raise CheckpointDiskFull(self._disk_full_line(step)) from None
            if detail := _not_finite_detail(e):
                kept = self.latest()
                raise CheckpointNotFinite(
                    f"checkpoint of step {step} not saved: {detail.split(': ', 1)[-1]}; "
                    f"{f'{kept.name} and `latest` are' if kept else 'no earlier checkpoint is'} intact. The "
                    "weights went bad: lower the learning rate or check the optimizer settings, then resume"
                ) from None
            raise

    def _disk_full_line(self, step: int) -> str:
        free = shutil.disk_usage(self.dir).free if self.dir.exists() else 0
        kept = self.latest()
        return (
            f"checkpoint of step {step} not saved: no space left on device in {self.dir} ({free / 2**20:.0f} MiB "
            f"free); it was discarded and {f'{kept.name} and `latest` are' if kept else 'no earlier checkpoint is'} "
            "intact; free space (or lower trainer.keep_last) and resume"
        )

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
        is named in the error. Files listed in the manifest must exist with their recorded sizes and
        SHA-256 digests.
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


def read_manifest(path: str | os.PathLike, require: Sequence[str] = (), _hint: bool = True) -> dict:
    """Load `path/manifest.json` and verify the files against it (see CheckpointManager.validate); a
    damaged file is named, with the newest earlier checkpoint that verifies."""
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
        manifest = json.loads(mpath.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath} is not valid JSON: {e}{_previous_hint(path) if _hint else ''}") from e
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
                    f"checkpoint {path}: part '{name}' file {f} has {f.stat().st_size} bytes, manifest says "
                    f"{size}{_previous_hint(path) if _hint else ''}"
                )
    for name, info in parts.items():  # after the cheap checks: hashing reads every byte
        for rel, digest in info.get("sha256", {}).items():
            f = path / name / rel if rel else path / name
            if sha256_file(f) != digest:
                raise CheckpointError(
                    f"checkpoint {path}: file {f} does not match the SHA-256 in its manifest (corrupted or "
                    f"replaced){_previous_hint(path) if _hint else ''}"
                )
    return manifest


def _previous_hint(path: Path) -> str:
    """'; previous valid checkpoint: .../step_K (trainer.resume=K)' for a damaged checkpoint, or ''."""
    m = _STEP_RE.match(path.name)
    if not m:
        return ""
    earlier = sorted(
        (int(g.group(1)) for p in path.parent.iterdir() if (g := _STEP_RE.match(p.name))),
        reverse=True,
    )
    for step in (s for s in earlier if s < int(m.group(1))):
        try:
            read_manifest(path.parent / f"step_{step}", _hint=False)
        except CheckpointError:
            continue
        return f"; previous valid checkpoint: {path.parent / f'step_{step}'} (trainer.resume={step})"
    return "; no earlier valid checkpoint"


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
