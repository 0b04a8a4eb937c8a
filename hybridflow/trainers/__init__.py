"""Drivers: one short trainer per algorithm on top of the role worker groups (docs/design.md §2).

base.py          Trainer: config -> Ray, pools + worker groups, data, tracker; the step loop,
                 validation (val/{data_source}/acc@1), checkpoint hooks
placement.py     Placement: which pool each role runs on (colocate / split / custom)
rl.py            RLTrainer: the phases of online RL (generate, old/ref log-probs, values, reward, KL)
ppo.py           PPO: the paper's eight-line loop, each phase in a named timer
grpo.py rloo.py reinforce_pp.py remax.py safe_rlhf.py   small edits of PPO
offline.py       SFT (warm start) and DPO (preference pairs)
metrics.py       per-step data metrics, timers, throughput
cli.py           `hybridflow train CONFIG [overrides]`
eval_cli.py      `hybridflow eval SOURCE [overrides]`: validation only, from a checkpoint or an HF directory
"""

from hybridflow.trainers.base import Trainer
from hybridflow.trainers.grpo import GRPOTrainer
from hybridflow.trainers.offline import DPOTrainer, SFTTrainer
from hybridflow.trainers.placement import Placement
from hybridflow.trainers.ppo import PPOTrainer
from hybridflow.trainers.reinforce_pp import ReinforcePPTrainer
from hybridflow.trainers.remax import ReMaxTrainer
from hybridflow.trainers.rloo import RLOOTrainer
from hybridflow.trainers.safe_rlhf import SafeRLHFTrainer

TRAINERS = {
    "ppo": PPOTrainer,
    "grpo": GRPOTrainer,
    "remax": ReMaxTrainer,
    "rloo": RLOOTrainer,
    "reinforce_pp": ReinforcePPTrainer,
    "safe_rlhf": SafeRLHFTrainer,
    "dpo": DPOTrainer,
    "sft": SFTTrainer,
}


def build_trainer(config, placement: Placement | None = None, groups: dict | None = None) -> Trainer:
    """The trainer of config.algorithm.name, with its worker groups started (or `groups` reused)."""
    name = config.algorithm.name
    if name not in TRAINERS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(TRAINERS)}")
    return TRAINERS[name](config, placement, groups)


__all__ = [
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
