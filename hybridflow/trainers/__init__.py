"""Drivers: one short trainer per algorithm on top of the role worker groups (docs/design.md §2).

base.py          Trainer: config -> Ray, pools + worker groups, data, tracker; the step loop,
                 validation (val/{data_source}/acc@1), checkpoint hooks
placement.py     Placement: which pool each role runs on (colocate / split / custom)
rl.py            RLTrainer: the phases of online RL (generate, old/ref log-probs, values, reward, KL), as futures
experience.py    Pending (a step's batch in flight) and make_experience (advantages on the actor's rank 0)
sources/         rollout sources: where each step's batch comes from (synchronous, one step ahead)
ppo.py           PPO: the paper's eight-line loop, each phase in a named timer
grpo.py rloo.py reinforce_pp.py remax.py safe_rlhf.py   small edits of PPO
dapo.py          DAPO: GRPO + dynamic sampling (more prompts until the batch is full), overlong shaping
offline.py       SFT (warm start) and DPO (preference pairs)
metrics.py       per-step data metrics, timers, throughput
cli.py           `hybridflow train CONFIG [overrides]`
eval_cli.py      `hybridflow eval SOURCE [overrides]`: validation only, from a checkpoint or an HF directory
"""

from hybridflow._lazy import lazy_exports

# name -> submodule, loaded on first use (PEP 562) so `hybridflow train --help` does not import torch/Ray
_LAZY = {
    "Trainer": "base",
    "DAPOTrainer": "dapo",
    "GRPOTrainer": "grpo",
    "DPOTrainer": "offline",
    "SFTTrainer": "offline",
    "Placement": "placement",
    "PPOTrainer": "ppo",
    "ReinforcePPTrainer": "reinforce_pp",
    "ReMaxTrainer": "remax",
    "RLOOTrainer": "rloo",
    "SafeRLHFTrainer": "safe_rlhf",
}
_lazy = lazy_exports(__name__, _LAZY)


def __getattr__(name: str):
    if name == "TRAINERS":
        return _trainers()
    return _lazy(name)


def _trainers() -> dict:
    """algorithm name -> trainer class, keyed by the spec each class carries (config/algorithms.py)."""
    names = ("PPOTrainer", "GRPOTrainer", "DAPOTrainer", "ReMaxTrainer", "RLOOTrainer", "ReinforcePPTrainer",
             "SafeRLHFTrainer", "DPOTrainer", "SFTTrainer")  # fmt: skip
    return {cls.spec.name: cls for cls in map(_lazy, names)}


def build_trainer(config, placement=None, groups: dict | None = None):
    """The trainer of config.algorithm.name, with its worker groups started (or `groups` reused)."""
    name = config.algorithm.name
    trainers = _trainers()
    if name not in trainers:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(trainers)}")
    return trainers[name](config, placement, groups)


__all__ = [
    "DAPOTrainer",
    "DPOTrainer",
    "GRPOTrainer",
    "PPOTrainer",
    "Placement",
    "RLOOTrainer",
    "ReMaxTrainer",
    "ReinforcePPTrainer",
    "SFTTrainer",
    "SafeRLHFTrainer",
    "TRAINERS",
    "Trainer",
    "build_trainer",
]
