"""Offline trainers on the same worker groups: SFT (the warm start before RL) and DPO (preference
pairs, no generation). Both validate by generation like the RL trainers, so runs compare directly."""

from __future__ import annotations

from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.data import StatefulDataLoader, build_pair_dataset
from hybridflow.data.traces import ToolOutputs
from hybridflow.trainers.base import Trainer


class _PairTrainer(Trainer):
    kind = ""
    offline = True

    def max_length(self) -> int:
        """Cap on prompt + response tokens of a training pair (0 = only the per-part limits)."""
        return 0

    def build_train_loader(self) -> StatefulDataLoader:
        d = self.cfg.data
        cap = self.max_length()  # SFT: a response gets what its prompt leaves of max_length
        m = self.cfg.rollout.multi_turn  # traces' tool outputs tokenized as the agent loop inserts them
        outputs = ToolOutputs(m.tool_response_template, m.max_tool_output_tokens) if m.enable else None
        ds = build_pair_dataset(
            d,
            self.tokenizer,
            self.kind,
            "train",
            cap or self.cfg.rollout.response_length,
            cap,
            self.tools,
            outputs,
        )
        if ds is None:
            raise ValueError(f"{self.name}: no training data; set data.train_files or data.dataset")
        return StatefulDataLoader(ds, d.train_batch_size, shuffle=d.shuffle, seed=d.seed)

    def role_kwargs(self) -> dict[str, dict]:
        return {"actor_rollout": {"total_optim_steps": self.total_steps}}


class SFTTrainer(_PairTrainer):
    """Supervised fine-tuning: token-mean NLL of the `response` column's model tokens (a tool-use
    trace's tool outputs are masked: data/traces.py), one optimizer step per batch."""

    name, kind = "sft", "sft"
    spec = ALGORITHM_SPECS["sft"]

    def max_length(self) -> int:
        return self.cfg.algorithm.sft.max_length

    def train_step(self, batch: Batch) -> tuple[Batch, dict]:
        with self.timers("update_actor"):
            metrics = self.actor.train_sft(batch)
        return batch, metrics


class DPOTrainer(_PairTrainer):
    """DPO: reference log-probs of both responses of each pair, then one optimizer step per batch."""

    name, kind = "dpo", "dpo"
    spec = ALGORITHM_SPECS["dpo"]  # pairs: validation checks data.train_batch_size divides the actor's dp

    def train_step(self, batch: Batch) -> tuple[Batch, dict]:
        if "ref" in self.groups:
            with self.timers("ref"):
                batch = batch.union(self.groups["ref"].compute_ref_log_prob(batch))
        with self.timers("update_actor"):
            metrics = self.actor.train_dpo(batch)
        return batch, metrics
