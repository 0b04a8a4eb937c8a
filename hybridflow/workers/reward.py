"""Rewards: a reward/cost *model* worker group, and the rule-reward path for verifiable tasks.

RewardModelWorker scores (prompt, response) with an HF sequence-classification model read at the
last attended token; the same class serves as Safe-RLHF's cost model (`score_key="cost_scores"`).
It assumes the reward model shares the policy's tokenizer (the batch's input_ids are scored as they
are); re-tokenising for a different reward tokenizer is not implemented.

RuleReward runs in the driver: it hands decoded responses to hybridflow.rewards.RewardExecutor (a
process pool with per-sample timeouts) and places each score on the response's last token.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms import place_score_on_last_token
from hybridflow.batch import Batch
from hybridflow.config.roles import RewardWorkerConfig
from hybridflow.controller import Protocol, Worker, register
from hybridflow.engines import TrainEngine
from hybridflow.models import load_reward_model
from hybridflow.rewards import RewardExecutor
from hybridflow.workers.common import engine_config, seed_everything, set_train_layout


class RewardModelWorker(Worker):
    """config: the reward model's part of the config tree (config/roles.py); model_path: the HF
    sequence-classification directory; score_key: output field ("rm_scores" for reward, "cost_scores" for cost)."""

    def __init__(self, config: RewardWorkerConfig, model_path: str, score_key: str = "rm_scores"):
        self.config, self.model_path, self.score_key = config, model_path, score_key
        self.engine_cfg = engine_config(
            config.reward, self.world_size, "reward", config.seed, config.model.dtype,
            remove_padding=config.model.remove_padding, share_prompt=config.model.share_prompt,
        )  # fmt: skip
        set_train_layout(self, "train", self.engine_cfg.parallel)
        self.engine = None

    @register(Protocol.ONE_TO_ALL)
    def init_model(self) -> dict:
        seed_everything(self.config.seed)
        remote = self.config.model.trust_remote_code
        model = load_reward_model(
            self.model_path, device="meta", trust_remote_code=remote
        )  # each rank: its shards
        self.engine = TrainEngine(model, self.engine_cfg, trainable=False, device=self.device)
        return {f"{self.score_key}_params": self.engine.num_params()}

    @register(Protocol.THREE_D)
    def compute_reward(self, batch: Batch) -> Batch:
        """Sequence scores (B,) under `score_key`."""
        return Batch({self.score_key: self.engine.compute_scores(batch)})


class RuleReward:
    """Scores rollouts with a rule function (per data_source, or reward.fn) in the driver process.

    spec / fn_kwargs / timeout_s / num_workers / on_error / error_score as in the `reward` config.
    """

    def __init__(self, reward_cfg, fn: str | None = None):
        self.executor = RewardExecutor(reward_cfg, **({} if fn is None else {"fn": fn}))
        self.last_extras: list[dict] = []

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """-> (scores (B,) float32, metrics). Needs non_tensors response_text and ground_truth."""
        result = self.executor.score_batch(batch)
        self.last_extras = result.extras  # per sample, for the generations table and maj@n
        return torch.from_numpy(np.asarray(result.scores, dtype=np.float32)), result.metrics

    def close(self) -> None:
        self.executor.close()


def token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, Lr) with each score on the last valid response token."""
    return place_score_on_last_token(scores.float(), response_mask)
