"""On an automatic restart: the devices the run's placement needs, waited for, or fewer (dp shrinks).

A restart after a lost node (docs/operations.md, "Automatic recovery") finds a cluster with fewer
devices than the placement was built for. `fit_devices` then
1. waits up to trainer.restart_wait_s for the devices to come back (a node replaced by the cluster's
   autoscaler or scheduler), printing a progress line every PROGRESS_S;
2. if they do not and trainer.min_devices allows it, re-resolves the config for the largest device
   count n (min_devices <= n <= what the cluster has) that passes the same checks as at start
   (config/validate.py) and on which every actor mini-batch splits evenly over the new dp ranks, and
   rebuilds the placement from it; the caller then builds the groups and loads the last checkpoint,
   whose sharded parts load on any dp (docs/checkpoints.md);
3. otherwise stops the run with one line (`DevicesLost`, exit 1).
"""

from __future__ import annotations

import copy
import sys
import time

import ray

PROGRESS_S = 30.0


class DevicesLost(RuntimeError):
    """The cluster lacks the devices to continue the run after a restart (the CLI exits 1, one line)."""


def cluster_devices(use_gpu: bool | None) -> int:
    """Devices of the alive nodes: GPUs, or CPU slots (one CPU each, as ResourcePool reserves them)."""
    total = ray.cluster_resources()
    if use_gpu or (use_gpu is None and total.get("GPU", 0) >= 1):
        return int(total.get("GPU", 0))
    return int(total.get("CPU", 0))


def _say(text: str) -> None:
    print(f"hybridflow train: {text}", file=sys.stderr, flush=True)


def wait_for_devices(need: int, wait_s: float, use_gpu: bool | None, clock=time.monotonic) -> int:
    """Poll the cluster until it has `need` devices or `wait_s` passed; -> the devices it has."""
    start = clock()
    have, said = cluster_devices(use_gpu), -PROGRESS_S
    while have < need and clock() - start < wait_s:
        if clock() - start - said >= PROGRESS_S:
            said = clock() - start
            left = wait_s - said
            _say(f"waiting for devices: the cluster has {have} of the {need} this run needs "
                 f"(up to {left:.0f} s more, trainer.restart_wait_s)")  # fmt: skip
        time.sleep(min(1.0, max(0.0, wait_s - (clock() - start))))
        have = cluster_devices(use_gpu)
    return have


def shrunk_config(cfg, n: int):
    """`cfg` for n devices with every dp derived again -> (config, problems): the start-time checks
    and even actor mini-batches over the new dp (padding rows would change the loss)."""
    from hybridflow.config.validate import collect_errors, resolve_config

    cfg = copy.deepcopy(cfg)
    r = cfg.resources
    r.nnodes, r.n_gpus_per_node = (
        (n // r.n_gpus_per_node, r.n_gpus_per_node) if n % r.n_gpus_per_node == 0 else (1, n)
    )
    for section in (cfg.actor, cfg.critic, cfg.ref, cfg.reward):
        section.parallel.dp = 0
    cfg.trainer.min_devices = min(cfg.trainer.min_devices, n)
    cfg = resolve_config(cfg)
    problems = collect_errors(cfg, check_model=False)
    dp, rows = cfg.actor.parallel.dp, cfg.actor.ppo_mini_batch_size * cfg.rollout.n
    if dp and rows % dp:
        problems.append(
            f"a mini-batch of {rows} rows (actor.ppo_mini_batch_size x rollout.n) does not split evenly over dp={dp}"
        )
    return cfg, problems


def fit_devices(trainer) -> None:
    """Before a restart rebuilds the groups: wait for the placement's devices, or shrink (module doc)."""
    from hybridflow.trainers.auto_placement import PromptLengths
    from hybridflow.trainers.placement import Placement, _use_gpu

    cfg, trainer_cfg = trainer.cfg, trainer.cfg.trainer
    need, use_gpu = trainer.placement.num_devices, _use_gpu(trainer.cfg)
    have = wait_for_devices(need, trainer_cfg.restart_wait_s, use_gpu)
    if have >= need:
        return
    lost = f"the cluster has {have} of the {need} devices this run was placed on"
    if not trainer_cfg.min_devices:
        raise DevicesLost(
            f"{lost}, after waiting trainer.restart_wait_s={trainer_cfg.restart_wait_s:g}; add devices and resume, or set "
            "trainer.min_devices to continue on fewer (dp shrinks)"
        )
    if have < trainer_cfg.min_devices:
        raise DevicesLost(
            f"{lost}, fewer than trainer.min_devices={trainer_cfg.min_devices}; add devices and resume"
        )
    first = None
    for n in range(have, trainer_cfg.min_devices - 1, -1):
        new, problems = shrunk_config(cfg, n)
        if not problems:
            break
        first = first or f"on {n}: {problems[0]}"
    else:
        raise DevicesLost(
            f"{lost}; no device count from {have} down to trainer.min_devices={trainer_cfg.min_devices} fits the "
            f"config ({first}); add devices and resume, or change the batch"
        )
    planned = getattr(trainer.placement, "plan", None)  # auto re-plans at the prompts' length it planned
    wl = planned.workload if planned is not None else {}
    prompts = PromptLengths(wl.get("mean_prompt_len", 0.0), wl.get("longest_prompt_len", 0))
    trainer.cfg, trainer.placement = new, Placement.from_config(new, prompts)
    _say(
        f"continuing on {n} devices instead of {need}: {lost}; actor dp={new.actor.parallel.dp} (trainer.min_devices={trainer_cfg.min_devices})"
    )
