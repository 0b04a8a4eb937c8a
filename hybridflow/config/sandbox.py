"""`reward.sandbox`: the limits put on user reward code in the reward worker processes
(hybridflow/rewards/sandbox.py applies them; docs/operations.md says what is and is not isolated).
Importable without torch or Ray."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.fields import MAX_MB, MAX_SECONDS, domain_errors
from hybridflow.fields import setting as _f

PROCESS_MODES = ("auto", "pid_namespace", "subreaper")


@dataclass
class SandboxConfig:
    """Resource limits and process containment of reward code (rule rewards run in worker processes)."""

    memory_mb: int = _f(
        4096,
        "address space one sample's process may add to what the worker had mapped (RLIMIT_AS)",
        ge=1,
        le=MAX_MB,
    )
    cpu_s: float = _f(
        60.0, "CPU seconds one sample's process may use (RLIMIT_CPU, set per sample)", gt=0, le=MAX_SECONDS
    )
    max_procs: int = _f(
        256,
        "processes the reward code of one worker may have at once, its sample processes included "
        "(a pids cgroup where writable, else RLIMIT_NPROC over the user's current count)",
        ge=1,
        le=2**31 - 1,
    )
    file_size_mb: int = _f(1024, "largest file reward code may write (RLIMIT_FSIZE)", ge=1, le=MAX_MB)
    processes: str = _f(
        "auto",
        "how no process outlives its sample's worker: a PID namespace per worker (needs root or "
        "CAP_SYS_ADMIN), or a subreaper that kills every orphan; auto = the namespace where allowed",
        choices=PROCESS_MODES,
    )


def sandbox_errors(s: SandboxConfig) -> list[str]:
    """The problems of `reward.sandbox`, one message each, starting with the key."""
    return domain_errors(s, "reward.sandbox.")  # its fields' domains, for callers outside the config tree
