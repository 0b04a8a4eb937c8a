"""Run by test_cpu_threads.py in a subprocess with its own Ray cluster and no HYBRIDFLOW_CPU_THREADS
(the test session pins it to 1 in every worker): builds real trainers for several placements and
prints each worker group's torch threads per rank, as one RESULT line of JSON."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

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


def main() -> None:
    assert "HYBRIDFLOW_CPU_THREADS" not in os.environ
    tmp = Path(tempfile.mkdtemp(prefix="threads_check_"))
    model = save_tiny_model(tmp / "model", size="tiny", arch="llama", seed=0)
    start_local_ray(8)
    out = {"cores": len(os.sched_getaffinity(0))}
    for name in sys.argv[1:] or CASES:
        algo, devices, overrides = CASES[name]
        cfg = tiny_config(model, tmp / name, algo, *overrides, devices=devices)
        with build_trainer(cfg) as trainer:
            out[name] = {
                role: group.execute_all("apply", torch.get_num_threads)
                for role, group in trainer.groups.items()
            }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
