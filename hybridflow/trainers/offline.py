"""Offline trainers on the same worker groups: SFT (the warm start before RL) and DPO (preference
pairs, no generation). Both validate by generation like the RL trainers, so runs compare directly."""

from __future__ import annotations

from hybridflow.batch import Batch
from hybridflow.data import StatefulDataLoader, build_pair_dataset
from hybridflow.trainers.base import Trainer


class _PairTrainer(Trainer):
    kind = ""

    def build_train_loader(self) -> StatefulDataLoader:
        d = self.cfg.data
        ds = build_pair_dataset(
            d, self.tokenizer, self.kind, "train", max_response_length=self.cfg.rollout.response_length
        )
        if ds is None:
            raise ValueError(f"{self.name}: no training data; set data.train_files or data.dataset")
        return StatefulDataLoader(ds, d.train_batch_size, shuffle=d.shuffle, seed=d.seed)

    def roles(self) -> dict[str, dict]:
        return {"actor_rollout": {"total_optim_steps": self.total_steps}}


class SFTTrainer(_PairTrainer):
    """Supervised fine-tuning: token-mean NLL of the `response` column, one optimizer step per batch."""

    name, kind = "sft", "sft"

    def train_step(self, batch: Batch) -> tuple[Batch, dict]:
        with self.timers("update_actor"):
            metrics = self.actor.train_sft(batch)
        return batch, metrics


class DPOTrainer(_PairTrainer):
    """DPO: reference log-probs of both responses of each pair, then one optimizer step per batch."""

    name, kind = "dpo", "dpo"

    def __init__(self, config, placement=None, groups=None):
        super().__init__(config, placement, groups)
        p = self.cfg.actor.parallel
        dp = self.placement.pools[self.placement.pool_of("actor_rollout")] // (p.tp * p.pp)
        if self.cfg.data.train_batch_size % dp:
            self.close()
            raise ValueError(
                f"dpo: data.train_batch_size {self.cfg.data.train_batch_size} pairs must divide evenly over the "
                f"actor's dp={dp} ranks (both rows of a pair must land on the same rank)"
            )

    def roles(self) -> dict[str, dict]:
        roles = super().roles()
        if not self.cfg.algorithm.dpo.reference_free:
            roles["ref"] = {}
        return roles

    def train_step(self, batch: Batch) -> tuple[Batch, dict]:
        if "ref" in self.groups:
            with self.timers("ref"):
                batch = batch.union(self.groups["ref"].compute_ref_log_prob(batch))
        with self.timers("update_actor"):
            metrics = self.actor.train_dpo(batch)
        return batch, metrics
