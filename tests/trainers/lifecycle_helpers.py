"""Helpers of the CLI, lifecycle and elastic tests and benchmarks/chaos.py: the GRPO config they run,
`hybridflow train` as a child process, the processes it started (by pid, from /proc), the TCP ports they
listen on, worker processes to kill, and metrics rows to compare across runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

# dense and tied to the answer, so greedy validation numbers move with the weights
REWARD = """def overlap(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c in ground_truth for c in solution_str) / 4.0
"""


def grpo_config(
    tmp: Path,
    model,
    data: str = "num_samples: 64, val_size: 4",
    resources: str = "n_gpus_per_node: 1",
    trainer: str = "experiment_name: run, total_steps: 8, save_every: 2, loggers: [console, jsonl]",
) -> Path:
    """tmp/grpo.yaml: GRPO on the tiny model and synthetic arithmetic, rewarded by tmp/reward.py (a
    user file, so reward workers run); `data` (dataset_kwargs), `resources` and `trainer` are flow
    mappings' contents; runs go to tmp/<experiment_name>."""
    (tmp / "reward.py").write_text(REWARD)
    path = tmp / "grpo.yaml"
    path.write_text(
        "algorithm: {name: grpo}\n"
        f"model: {{path: {model}}}\n"
        f"data: {{dataset: 'synthetic:arithmetic', dataset_kwargs: {{{data}}},"
        " max_prompt_length: 16, train_batch_size: 4}\n"
        "actor: {ppo_mini_batch_size: 4, optim: {lr: 2.0e-2}}\n"
        "rollout: {n: 2, response_length: 4}\n"
        f"reward: {{fn: '{tmp / 'reward.py'}:overlap', num_workers: 0}}\n"
        f"resources: {{device: cpu, {resources}}}\n"
        f"trainer: {{output_dir: '{tmp}', {trainer}}}\n"
    )
    return path


def comparable(row: dict) -> dict:
    """A metrics row without what differs between equal runs (timings, throughput, restart counts, a
    plan's predicted seconds: only planned runs log them)."""
    skip = ("timing_s/", "perf/", "trainer/", "plan/")
    return {k: v for k, v in row.items() if not k.startswith(skip) and not k.endswith("_time_s")}


def start_train(config: Path, *overrides: str, log: Path) -> subprocess.Popen:
    """`python -m hybridflow.cli train CONFIG OVERRIDES` in its own session (so a Ctrl-C to its process
    group reaches it the way a terminal's would), output to `log`."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = open(log, "w")
    cmd = [sys.executable, "-m", "hybridflow.cli", "train", str(config), *overrides]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def alive(pids) -> list[int]:
    out = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(p)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pids(pid: int) -> list[int]:
    """The run's worker-group processes (Ray actors of hybridflow's WorkerProcess)."""
    return sorted(p for p in descendants(pid) if cmdline(p).startswith("ray::WorkerProcess"))


def listening(pids) -> dict[int, list[str]]:
    """pid -> the local addresses (ip:port) it listens on (TCP), from `ss -ltnp`."""
    text = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    out: dict[int, list[str]] = {}
    for line in text.splitlines():
        for p in pids:
            if f"pid={p}," in line:
                out.setdefault(p, []).append(line.split()[3])
    return out


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 600.0, poll: float = 0.05):
    """Poll until predicate() is truthy (-> its value); fails if the process ends first or on timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before the awaited state")
        time.sleep(poll)
    raise AssertionError("timed out waiting for the run")


def kill_a_worker_after(run_dir: Path, step: int, proc: subprocess.Popen, pick=min) -> int:
    """SIGKILL one of the run's worker processes (`pick` of their pids) once metrics row `step` is
    written (its checkpoint, if due, is committed right after it), i.e. during step + 1; -> the pid."""
    import signal

    wait_for(lambda: any(r["step"] == step for r in metric_rows(run_dir)), proc, poll=0.01)
    victim = pick(worker_pids(proc.pid))
    os.kill(victim, signal.SIGKILL)
    return victim


def assert_rollout_pool_greedy_equals_actor(trainer, n_prompts: int) -> None:
    """After a last weight sync, the rollout pool decodes greedily as the trained actor does (same tokens,
    log-probs within 1e-5): the rollout_ahead tests' check that the synced weights are the actor's."""
    trainer.source.sync(trainer.global_step)
    prompts = trainer.val_dataset.collate([trainer.val_dataset[i] for i in range(n_prompts)])
    greedy = {"n": 1, "temperature": 0.0}
    ours, theirs = (
        g.generate_sequences(prompts, sampling=greedy) for g in (trainer.actor, trainer.groups["rollout"])
    )
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.allclose(ours["rollout_log_probs"], theirs["rollout_log_probs"], atol=1e-5)
