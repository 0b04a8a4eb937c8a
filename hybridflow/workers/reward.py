"""Rewards: a reward/cost *model* worker group, and the rule-reward path for verifiable tasks.

RewardModelWorker scores (prompt, response) with an HF sequence-classification model read at the
last attended token; the same class serves as Safe-RLHF's cost model (`score_key="cost_scores"`).
It assumes the reward model shares the policy's tokenizer (the batch's input_ids are scored as they
are); re-tokenising for a different reward tokenizer is not implemented.

RuleReward runs in the driver: it hands decoded responses to hybridflow.rewards.RewardExecutor (a
process pool with per-sample timeouts), one per function of reward.fns, and sums their weighted scores
over the functions that scored each sample (a function returning None does not score it, as in TRL).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from hybridflow.algorithms import place_score_on_last_token
from hybridflow.batch import Batch
from hybridflow.config.roles import RewardWorkerConfig
from hybridflow.config.schema import RewardConfig, reward_fn_name
from hybridflow.controller import Protocol, Worker, register
from hybridflow.engines import TrainEngine
from hybridflow.models import load_reward_model
from hybridflow.rewards import RewardExecutor
from hybridflow.workers.common import engine_config, seed_everything, set_train_layout

logger = logging.getLogger("hybridflow.rewards")


class RewardModelWorker(Worker):
    """config: the reward model's part of the config tree (config/roles.py); model_path: the HF
    sequence-classification directory; score_key: output field ("rm_scores" for reward, "cost_scores" for cost)."""

    def __init__(self, config: RewardWorkerConfig, model_path: str, score_key: str = "rm_scores"):
        self.config, self.model_path, self.score_key = config, model_path, score_key
        self.engine_cfg = engine_config(
            config.reward, self.world_size, "reward", config.seed, config.model.dtype,
            remove_padding=config.model.remove_padding, share_prompt=config.model.share_prompt,
            cpu_gemm=config.model.cpu_gemm,
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


def check_reward_sources(reward_cfg: RewardConfig, datasets) -> None:
    """A rule reward that dispatches on data_source (reward.fn '', or a reward.fns entry's fn '') has a
    registered function for every prompt's: else one ConfigError line naming the first prompt without
    one, before Ray, instead of a failure in the first step's reward."""
    from hybridflow.config import ConfigError
    from hybridflow.rewards import get_reward_fn

    specs = [e.fn for e in reward_cfg.fns] if reward_cfg.fns else [reward_cfg.fn]
    if "" not in specs:
        return
    for ds in datasets:
        first = {}  # data_source -> its first prompt
        for s in getattr(ds, "samples", ()):
            first.setdefault(s.data_source, s.index)
        for source, index in first.items():
            try:
                get_reward_fn(source)
            except KeyError as e:
                raise ConfigError([f"{ds.name}, prompt {index + 1}: {e.args[0]}"]) from None


class RuleReward:
    """Scores rollouts with rule functions in the driver process: reward.fn (or `fn`, e.g. Safe-RLHF's
    cost_fn), or the weighted sum of reward.fns, each component logged as reward/<name>/mean.

    columns: the dataset's columns, against which a TRL-convention function's are checked at start-up;
    max_steps: the run's trainer.total_steps (a TRL function's trainer_state.max_steps);
    output_dir: the run directory, where each reward worker's last output is kept (reward_output/)."""

    def __init__(
        self,
        reward_cfg: RewardConfig,
        fn: str | None = None,
        columns: set[str] | None = None,
        max_steps: int = 0,
        output_dir: str | None = None,
    ):
        self.parts: list[tuple[str, float, RewardExecutor]] = []  # (name, weight, executor)
        out = {"output_dir": output_dir}  # the run directory: each reward worker's last output
        try:
            if fn is not None or not reward_cfg.fns:
                self.parts.append(
                    (
                        "",
                        1.0,
                        RewardExecutor(reward_cfg, columns, **out, **({} if fn is None else {"fn": fn})),
                    )
                )
            for e in [] if fn is not None else reward_cfg.fns:
                executor = RewardExecutor(reward_cfg, columns, **out, fn=e.fn, fn_kwargs=e.fn_kwargs)
                self.parts.append((reward_fn_name(e), e.weight, executor))
        except BaseException:
            self.close()  # the workers of the functions already started
            raise
        self.last_extras: list[dict] = []
        self.max_steps = max_steps  # the run's length: TRL-convention functions' trainer_state.max_steps

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """-> (scores (B,) float32, metrics). Needs non_tensors response_text and ground_truth."""
        state = {"global_step": int(batch.meta.global_step or 0), "max_steps": self.max_steps}
        results = [(name, weight, ex.score_batch(batch, state)) for name, weight, ex in self.parts]
        total, unscored = weighted_sum([(w, r.scores) for _, w, r in results])
        metrics: dict[str, float] = {
            "reward/unscored_fraction": float(unscored.mean()) if len(total) else 0.0
        }
        for name, _, r in results:
            metrics = merge_metrics(metrics, r.metrics)
            if name and not np.isnan(r.scores).all():  # the mean over the samples it scored, as TRL logs it
                metrics[f"reward/{name}/mean"] = float(np.nanmean(r.scores))
        if unscored.any():
            logger.warning(
                "%d of %d samples were scored by no reward function (each returned None): scored 0",
                int(unscored.sum()), len(total),
            )  # fmt: skip
        # per sample, for the generations table and maj@n: each function's other returned keys
        self.last_extras = [
            {k: v for _, _, r in results for k, v in r.extras[i].items()} for i in range(len(total))
        ]
        return torch.from_numpy(np.asarray(total, dtype=np.float32)), metrics

    def close(self) -> None:
        for _, _, executor in self.parts:
            executor.close()


def weighted_sum(parts: list[tuple[float, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """sum of weight * score over the functions that scored each sample (NaN: returned None, TRL's
    nansum), and the mask of samples no function scored (their sum: 0, as TRL's)."""
    stacked = np.stack([s.astype(np.float64) for _, s in parts])
    weights = np.array([w for w, _ in parts], dtype=np.float64)[:, None]
    scored = ~np.isnan(stacked)
    return np.where(scored, weights * np.nan_to_num(stacked), 0.0).sum(0), ~scored.any(0)


def merge_metrics(into: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    """Several functions' executor metrics as one: counts and times add up, the error fraction is the
    largest, reward/extra/* means are kept as the first function that returned the key reported them."""
    out = dict(into)
    for k, v in more.items():
        if k not in out:
            out[k] = v
        elif k == "reward/error_fraction":
            out[k] = max(out[k], v)
        elif not k.startswith("reward/extra/"):
            out[k] += v
    return out


def token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) sequence scores -> (B, Lr) with each score on the last valid response token."""
    return place_score_on_last_token(scores.float(), response_mask)
