"""Role workers: the SPMD programs the single controller drives (docs/design.md §3).

actor.py    ActorRolloutRefWorker: actor (PPO update, SFT, DPO), rollout (generation on the actor's
            own weights), ref (frozen log-probs); any subset of roles in one process
critic.py   CriticWorker: values and the clipped value update (also Safe-RLHF's cost critic)
reward.py   RewardModelWorker (reward or cost model scores) and RuleReward (verifiable rewards)
losses.py   adapters from engine micro-batch outputs to hybridflow.algorithms (PPO, value, DPO, SFT)
common.py   config -> EngineConfig, layouts, the mini-batch/epoch loop, metric lists
"""

from hybridflow.workers.actor import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward import RewardModelWorker, RuleReward, token_level

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker", "RuleReward", "token_level"]
