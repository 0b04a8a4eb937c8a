"""Filesystem helpers of the checkpoint writer: fsync, atomic text writes, SHA-256 of files, and the
owner tag (host~pid) in temp directory names (see manager.py)."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import uuid
from pathlib import Path


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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def owner_tag() -> str:
    """`host~pid` of this process, put into temp/trash directory names so that `begin` can tell
    leftovers of a dead writer from the directory a live one is filling."""
    return f"{socket.gethostname().replace('-', '_').replace('~', '_')}~{os.getpid()}"


def owner_alive(name: str) -> bool:
    """Whether the writer named in a temp/trash directory name may still be running. Names without an
    owner (older versions) count as dead; owners on another host as alive (nothing to ask)."""
    m = re.search(r"-([^-~]+)~(\d+)-[0-9a-f]{8}$", name)
    if not m:
        return False
    if m.group(1) != owner_tag().split("~")[0]:
        return True
    try:
        os.kill(int(m.group(2)), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
