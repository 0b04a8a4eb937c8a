"""The torch / transformers / ray releases a run starts with, and the oldest ones it accepts.

Oldest supported (checked before Ray starts by `hybridflow train`, docs/operations.md "Supported versions"):
- torch 2.11: the GPU image's release. Everything the package calls exists there except
  `dist.all_gather_single` (torch 2.13), called through compat/dist.py. No torch but 2.13.0 installs on the
  dev machines, so 2.11 is established from torch's own history, not run here; the fallback path of every
  shim is run here by hiding the new API.
- transformers 5.17: the GPU image's release, and the oldest the test suite's model, engine, rollout and
  checkpoint tests were run against (a scratch install beside the dev venv). 5.17-5.22 lack
  `activation_checkpointing_enable` (compat/hf.py).
- ray: logged, not checked (pinned in pyproject.toml; nothing version-dependent is known).
Versions are read from the installed distributions' metadata, so the check imports neither torch nor Ray.
"""

from __future__ import annotations

import logging
from importlib import metadata

from packaging.version import Version

from hybridflow.errors import UserError

MIN_VERSIONS = {"torch": (2, 11), "transformers": (5, 17)}
REPORTED = ("torch", "transformers", "ray")

log = logging.getLogger(__name__)


def installed_versions() -> dict[str, str]:
    """{distribution: version string} of REPORTED ("missing" where one is not installed)."""
    found = {}
    for name in REPORTED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "missing"
    return found


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.11.0+cu130" and "2.11.0a0+git1234" -> (2, 11, 0).
    Pre-release and local tags are ignored on purpose: vendor images ship torch as 2.11.0a0+<build>."""
    return Version(version).release


def check_versions(found: dict[str, str] | None = None) -> str:
    """One line naming the versions found; raises UserError, naming the first release below its minimum."""
    found = installed_versions() if found is None else found
    for name, minimum in MIN_VERSIONS.items():
        have = found.get(name, "missing")
        if have == "missing" or release(have)[: len(minimum)] < minimum:
            want = ".".join(map(str, minimum))
            raise UserError(
                f"hybridflow needs {name} >= {want}, found {have} (docs/operations.md, 'Supported versions')"
            )
    return ", ".join(f"{name} {found.get(name, 'missing')}" for name in REPORTED)


def log_and_check_versions() -> None:
    """check_versions(), logging the versions first so a refused run's log still names them."""
    found = installed_versions()
    log.info("versions: %s", ", ".join(f"{k} {v}" for k, v in found.items()))
    check_versions(found)
