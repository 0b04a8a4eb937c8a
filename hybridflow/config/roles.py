"""Each role worker's part of the config tree: what its process reads, and nothing else.

The driver holds the whole resolved tree (config/schema.py); a worker group is built with its role's
config only, so a worker cannot come to depend on another role's settings, and a change to a setting it
does not read (the critic's learning rate, the data files, the checkpoint schedule) does not reach it.
`worker_config` cuts it from the tree the placement wrote the role's parallel sizes into
(trainers/placement.role_config). The sections are the tree's own classes, copied: one name, one thing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from hybridflow.config.algorithm_config import AlgorithmConfig
from hybridflow.config.schema import (
    ActorConfig,
    CriticConfig,
    HybridFlowConfig,
    ModelConfig,
    RefConfig,
    RewardConfig,
    RolloutConfig,
)


@dataclass
class ActorWorkerConfig:
    """ActorRolloutRefWorker (actor, rollout and reference roles, any subset): the policy's sections, the
    algorithm section (its loss terms: KL loss, entropy bonus, DPO), and the few run settings it reads."""

    model: ModelConfig
    actor: ActorConfig
    rollout: RolloutConfig
    ref: RefConfig
    algorithm: AlgorithmConfig
    seed: int  # trainer.seed: model init, sampling seeds
    device: str  # resources.device: the compute dtype of generation ("auto" = by the device found)
    max_prompt_length: int  # data.max_prompt_length: vLLM's context (+ rollout.response_length)
    prompts_per_step: int  # the larger of data.train_batch_size / val_batch_size: vLLM's sequences per call


@dataclass
class CriticWorkerConfig:
    """CriticWorker (the value model; Safe-RLHF's cost critic too)."""

    model: ModelConfig
    critic: CriticConfig
    seed: int  # trainer.seed
    response_length: int  # rollout.response_length: the constant of loss_agg_mode seq-mean-token-sum-norm


@dataclass
class RewardWorkerConfig:
    """RewardModelWorker (a reward or cost model; which directory is the worker's own argument)."""

    model: ModelConfig
    reward: RewardConfig
    seed: int  # trainer.seed


WorkerConfig = ActorWorkerConfig | CriticWorkerConfig | RewardWorkerConfig
ACTOR_ROLES = ("actor_rollout", "rollout", "ref")
CRITIC_ROLES = ("critic", "cost_critic")
REWARD_ROLES = ("reward", "cost")


def worker_config(cfg: HybridFlowConfig, role: str) -> WorkerConfig:
    """The config of `role`'s worker (a placement role: trainers/placement.ROLES), cut from the resolved
    tree `cfg` and copied, so later changes to `cfg` do not reach it."""
    cfg = copy.deepcopy(cfg)
    if role in ACTOR_ROLES:
        d = cfg.data
        return ActorWorkerConfig(
            model=cfg.model,
            actor=cfg.actor,
            rollout=cfg.rollout,
            ref=cfg.ref,
            algorithm=cfg.algorithm,
            seed=cfg.trainer.seed,
            device=cfg.resources.device,
            max_prompt_length=d.max_prompt_length,
            prompts_per_step=max(d.train_batch_size, d.val_batch_size),
        )
    if role in CRITIC_ROLES:
        return CriticWorkerConfig(
            model=cfg.model,
            critic=cfg.critic,
            seed=cfg.trainer.seed,
            response_length=cfg.rollout.response_length,
        )
    if role in REWARD_ROLES:
        return RewardWorkerConfig(model=cfg.model, reward=cfg.reward, seed=cfg.trainer.seed)
    raise ValueError(
        f"worker_config: unknown role {role!r}; known: {ACTOR_ROLES + CRITIC_ROLES + REWARD_ROLES}"
    )
