"""The sandboxed code tool: model-written Python run in a process of its own, contained
(agent/_code_runner.py says how, docs/rollout.md what is and is not isolated).

Limits come from `rollout.multi_turn.sandbox` (config/sandbox.py's SandboxConfig, the reward sandbox's
settings: CPU seconds, memory, file size, processes). Each call gets a fresh temporary directory
(removed after), an environment holding only PATH, HOME and TMPDIR (none of the trainer's variables),
`timeout_s` of wall time after which the whole process tree is killed, and at most `max_output_bytes`
of output read back (then killed too). Every failure is one line of the tool's answer.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from hybridflow.agent.tools import Tool, ToolTimeout
from hybridflow.config.sandbox import SandboxConfig
from hybridflow.rewards.sandbox import cgroup_dir, remove_cgroup

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_code_runner.py")


@dataclass(frozen=True)
class CodeResult:
    output: str
    exit_code: int | None
    error: str = ""
    """One line when the code was stopped or failed: timeout, output cap, CPU, memory, a signal."""
    timed_out: bool = False
    mode: str = ""
    """How it was contained: namespaces, user_namespaces or subreaper."""

    @property
    def text(self) -> str:
        """What the model is answered with."""
        return self.output + (f"\n{self.error}" if self.error else "")


def code_tool(cfg: SandboxConfig, timeout_s: float, max_output_bytes: int = 65536) -> Tool:
    """The `python` tool: runs the code in the sandbox, answers with what it printed (and the error line)."""

    def python(code: str) -> str:
        """Run Python code in a sandbox and return what it prints.

        Args:
            code: a Python program; print the values you need
        """
        result = run_python(code, cfg, timeout_s, max_output_bytes)
        if result.timed_out:
            raise ToolTimeout(result.text)
        return result.text

    return Tool("python", python, Tool.from_function(python).schema, kills_on_timeout=True)


def run_python(code: str, cfg: SandboxConfig, timeout_s: float, max_output_bytes: int = 65536) -> CodeResult:
    workdir = tempfile.mkdtemp(prefix="hybridflow-code-")
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        args = [sys.executable, "-I", RUNNER, str(cfg.cpu_s), str(cfg.memory_mb), str(cfg.file_size_mb),
                str(cfg.max_procs), cfg.processes]  # fmt: skip
        proc = subprocess.Popen(args, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
        return _collect(proc, cfg, timeout_s, max_output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, cfg: SandboxConfig, timeout_s: float, cap: int) -> CodeResult:
    """Read stdout and stderr until the process ends, the deadline passes or the output passes `cap`."""
    deadline = time.monotonic() + timeout_s
    out, err, error, timed_out = bytearray(), bytearray(), "", False
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    while streams:
        left = deadline - time.monotonic()
        if left <= 0:
            error, timed_out = f"error: the code ran past the {timeout_s:g} s timeout and was killed", True
            break
        ready, _, _ = select.select(list(streams), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                streams[fd].extend(chunk)
            else:
                del streams[fd]
        if len(out) + len(err) > cap + 4096:
            error = f"error: the code printed more than {cap} bytes and was killed"
            break
    _kill_tree(proc)
    mode, _, stderr = bytes(err).decode(errors="replace").partition("\n")
    text = (bytes(out) + stderr.encode())[:cap].decode(errors="replace")
    code = proc.returncode
    if not error and code not in (0, None):
        error = _exit_message(code, cfg, text)
    return CodeResult(text, code, error, timed_out, mode.strip())


def _kill_tree(proc: subprocess.Popen) -> None:
    """The runner's whole session; its init dies with it and takes the PID namespace along."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        stream.close()
    for _ in range(50):  # the runner's pids cgroup (root only), once the namespace's members are gone
        remove_cgroup(proc.pid)
        path = cgroup_dir(proc.pid)
        if not path or not os.path.isdir(path):
            break
        time.sleep(0.02)


def _exit_message(code: int, cfg: SandboxConfig, text: str) -> str:
    """code: the runner's status, which is 128 + signal when the code's process was killed."""
    if code in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return f"error: the code was killed (signal {code - 128}): past cpu_s={cfg.cpu_s:g} CPU seconds"
    if "MemoryError" in text:
        return f"error: the code ran out of its memory_mb={cfg.memory_mb} MiB"
    if "File too large" in text or code == 128 + signal.SIGXFSZ:
        return f"error: the code wrote past file_size_mb={cfg.file_size_mb} MiB"
    return f"error: the code exited with status {code}"
