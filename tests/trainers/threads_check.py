"""Run by test_cpu_threads.py in a subprocess with its own Ray cluster and no HYBRIDFLOW_CPU_THREADS
(the test session pins it to 1 in every worker) nor OMP_WAIT_POLICY / GOMP_SPINCOUNT (`make test`
exports the policy): builds real trainers for several placements and prints each worker group's torch
threads per rank and the OMP_WAIT_POLICY and GOMP_SPINCOUNT each rank's process started with, as one
RESULT line of JSON. Then the same for one placement on a fresh cluster whose driver sets
OMP_WAIT_POLICY itself ("passive": libgomp reads it case-blind)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import ray
import torch

from hybridflow.models.tiny import save_tiny_model
from hybridflow.trainers import build_trainer
from hybridflow.trainers.lifecycle import start_local_ray
from tests.trainers.configs import tiny_config

CASES = {  # name -> (algorithm, devices, overrides)
    "colocate_1": ("grpo", 1, []),
    "split_2": ("ppo", 2, ["resources.placement=split"]),
    "rollout_ahead_2": ("grpo", 2, ["trainer.rollout_ahead=1"]),
}


def start_env(key: str = "OMP_WAIT_POLICY") -> str | None:
    """`key` in the environment this process was started with (/proc: what libgomp read on load)."""
    with open("/proc/self/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    value = env.get(key.encode())
    return None if value is None else value.decode()


def refaults() -> int:
    """Page faults of a 256 MB tensor allocated and written again after one of that size was freed: ~0 where
    the freed memory stayed in the heap, one per page (or per 2 MB huge page: 128) where glibc unmapped it.
    The count is the process's, so the Ray worker's own threads add a few (18 seen under load)."""
    import resource

    torch.ones(256 << 20, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(256 << 20, dtype=torch.uint8)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def run_cases(model: Path, tmp: Path, names) -> dict:
    out = {}
    for name in names:
        algo, devices, overrides = CASES[name]
        cfg = tiny_config(model, tmp / name, algo, *overrides, devices=devices)
        with build_trainer(cfg) as trainer:
            out[name] = {
                role: group.execute_all("apply", torch.get_num_threads)
                for role, group in trainer.groups.items()
            }
            groups = trainer.groups.items()
            out[name + "_refaults"] = {role: group.execute_all("apply", refaults) for role, group in groups}
            for suffix, key in (("_wait_policy", "OMP_WAIT_POLICY"), ("_spin_count", "GOMP_SPINCOUNT")):
                out[name + suffix] = {
                    role: group.execute_all("apply", start_env, key) for role, group in groups
                }
    return out


def main() -> None:
    assert not {"HYBRIDFLOW_CPU_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MALLOC_CONF"} & set(
        os.environ
    )
    tmp = Path(tempfile.mkdtemp(prefix="threads_check_"))
    model = save_tiny_model(tmp / "model", size="tiny", arch="llama", seed=0)
    start_local_ray(8, compute_on_cpu=True)  # as start_ray does for a run on CPU
    out = {"cores": len(os.sched_getaffinity(0)), "driver_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    out.update(run_cases(model, tmp, sys.argv[1:] or CASES))
    ray.shutdown()
    os.environ["OMP_WAIT_POLICY"] = "passive"  # the user's own setting
    start_local_ray(8)  # compute_on_cpu=False: what a run on GPUs starts
    user = run_cases(model, tmp / "user", ["colocate_1"])
    out["user_wait_policy"] = user["colocate_1_wait_policy"]
    out["user_spin_count"] = user["colocate_1_spin_count"]
    out["gpu_run_refaults"] = user["colocate_1_refaults"]  # a cluster not started for CPU workers: glibc
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
