"""CriticWorker: the value model (PPO; Safe-RLHF runs two, one for reward and one for cost).

The critic starts from the policy's backbone with a zero value head (`init_critic_from_causal_lm`:
values start at 0, so the first GAE is the plain discounted return) unless `model.critic_path` is
already a token-classification checkpoint. `values_key` / `returns_key` name the batch fields this
critic reads and writes, so a cost critic is the same class with `values_key="cost_values"`.

Methods: init_model (ONE_TO_ALL), compute_values (3D_PROTO), update_critic (DP_METRICS: the
mini-batch/epoch loop, clipped value loss), save/load_checkpoint (ONE_TO_ALL).
"""

from __future__ import annotations

import json
import os

from hybridflow.batch import Batch
from hybridflow.checkpoint import load_engine_state, save_engine_state
from hybridflow.config.roles import CriticWorkerConfig
from hybridflow.controller import Protocol, Worker, register
from hybridflow.engines import TrainEngine
from hybridflow.models import init_critic_from_causal_lm, load_critic
from hybridflow.workers.common import (
    MetricLists,
    engine_config,
    iter_mini_batches,
    mask_padding,
    offload_metrics,
    seed_everything,
    set_train_layout,
)
from hybridflow.workers.losses import critic_loss_fn, split_aggregation

_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def _is_causal_lm_dir(path: str) -> bool:
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    return any(a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in archs)


class CriticWorker(Worker):
    """config: the critic's part of the config tree (config/roles.py); name: metric prefix ("critic",
    "cost_critic"); total_optim_steps as for the actor."""

    def __init__(
        self,
        config: CriticWorkerConfig,
        name: str = "critic",
        values_key: str = "values",
        returns_key: str = "returns",
        total_optim_steps: int = 0,
    ):
        self.config, self.name = config, name
        self.values_key, self.returns_key = values_key, returns_key
        self.engine_cfg = engine_config(
            config.critic,
            self.world_size,
            "critic",
            config.seed,
            config.model.dtype,
            total_optim_steps,
            remove_padding=config.model.remove_padding,
            share_prompt=config.model.share_prompt,
            cpu_gemm=config.model.cpu_gemm,
            lora=config.model.lora if config.model.lora.critic else None,
        )
        set_train_layout(self, "train", self.engine_cfg.parallel)
        self.engine = None

    @register(Protocol.ONE_TO_ALL)
    def init_model(self) -> dict:
        seed_everything(self.config.seed)
        m = self.config.model
        path, remote = m.critic_path or m.path, m.trust_remote_code
        # Each rank reads only its shards; from a causal-LM directory the value head starts at zero.
        model = load_critic(path, device="meta", trust_remote_code=remote)
        if _is_causal_lm_dir(path) and not any(p.is_meta for p in model.parameters()):
            seed = self.config.seed  # weights not sliceable: load them whole
            model = init_critic_from_causal_lm(path, seed=seed, trust_remote_code=remote)
        self.engine = TrainEngine(model, self.engine_cfg, trainable=True, device=self.device)
        return {f"{self.name}_params": self.engine.num_params()}

    @register(Protocol.THREE_D)
    def compute_values(self, batch: Batch) -> Batch:
        """Per-token values (B, Lr) under `values_key`."""
        return Batch({self.values_key: self.engine.compute_values(batch)})

    @register(Protocol.DP_METRICS, layout="train")
    def update_critic(self, batch: Batch) -> dict:
        """Clipped value regression on `returns_key` over critic.ppo_epochs x mini-batches."""
        c = self.config.critic
        keys = [*_FIELDS, self.values_key, self.returns_key]
        loss_fn = critic_loss_fn(c, self.values_key, self.returns_key, self.config.response_length)
        weighting = split_aggregation(c.loss_agg_mode)[1]
        num_mini = c.num_mini_batches  # resolve_config: train_batch_size / ppo_mini_batch_size
        metrics = MetricLists()
        rows = mask_padding(batch).select(keys)
        with self.engine.phase(optimizer=True):  # offload: state moves in and out once per update
            for mb in iter_mini_batches(rows, num_mini, c.ppo_epochs, self.engine.global_step):
                out = self.engine.train_step(mb, loss_fn, loss_weighting=weighting, global_metrics=True)
                metrics.add(out, f"{self.name}/")
        metrics.add(offload_metrics(self.engine), f"perf/{self.name}_")
        return metrics.as_dict()

    @register(Protocol.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """This critic's part of checkpoint `path`: path/<name>/ (see ActorRolloutRefWorker.save_checkpoint)."""
        save_engine_state(self.engine, os.path.join(path, self.name), self.rank)

    @register(Protocol.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        load_engine_state(self.engine, os.path.join(path, self.name), self.rank)
