"""Shared by the engine checkpoint tests: a synthetic RL batch, a loss and an engine config."""

from __future__ import annotations

from hybridflow.batch import Batch
from hybridflow.models.tiny import random_rl_batch


def make_batch(vocab_size: int, batch_size: int = 8, lp: int = 5, lr: int = 6, seed: int = 0) -> Batch:
    """Left-padded prompts, right-padded responses, random advantages."""
    return random_rl_batch(vocab_size, batch_size, lp, lr, seed)


def pg_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["log_probs"] * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1), {}


def engine_config(dp: int = 1):
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig

    # warmup makes the LR schedule's position matter; weight decay makes the step count matter
    optim = OptimConfig(lr=2e-2, warmup_steps=3, weight_decay=0.1)
    return EngineConfig(parallel=ParallelConfig(dp=dp), optim=optim, micro_batch_size_per_device=4)
