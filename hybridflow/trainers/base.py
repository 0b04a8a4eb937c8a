"""What every trainer shares: config -> Ray cluster, pools and worker groups, data, tracker; the step
loop with validation and checkpoint hooks. An algorithm only says which roles it needs
(`roles()`), what it trains on (`build_train_loader()`) and what one step does (`train_step`).

    trainer = build_trainer(cfg)          # hybridflow/trainers/__init__.py
    history = trainer.fit()               # list of per-step metric dicts (also sent to the tracker)
    trainer.close()

Checkpoints (`save_checkpoint` / `load_checkpoint`, auto-resume from run_dir/checkpoints) hold each
trainable worker group's sharded state plus the loader position and the trainer's own state
(`extra_state`: KL coefficient, Lagrange multiplier); retention, export and the resume CLI are
hybridflow/checkpoint's business (issue 5), which can build on these hooks.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict

import numpy as np
import ray

from hybridflow.batch import Batch
from hybridflow.config import resolve_config, validate_config
from hybridflow.controller import ensure_ray
from hybridflow.data import StatefulDataLoader, build_prompt_dataset
from hybridflow.models import load_tokenizer
from hybridflow.trainers.metrics import Timers, throughput_metrics
from hybridflow.trainers.placement import Placement, build_worker_groups, shutdown
from hybridflow.workers import RuleReward


def start_ray(cfg, num_devices: int) -> None:
    """Join resources.ray_address, or start an embedded local cluster with room for every device."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = cfg.resources.ray_address or None
    kwargs = {"address": address}
    if address is None:
        kwargs["num_cpus"] = max(cfg.resources.ray_num_cpus or os.cpu_count() or 1, num_devices)
    ensure_ray(log_to_driver=False, **kwargs)


class Trainer:
    """Base of every algorithm's trainer. `config`: a HybridFlowConfig; `placement`: pools and roles
    (default: from resources.placement); `groups`: worker groups of another trainer to drive instead
    of starting new ones (e.g. comparing advantage estimators on the same workers) — their
    worker-side settings (models, actor/critic sections, KL loss) are the ones they were built with,
    and this trainer does not shut them down."""

    name = "base"

    def __init__(self, config, placement: Placement | None = None, groups: dict | None = None):
        self.cfg = cfg = resolve_config(config)
        validate_config(cfg)
        self.placement = placement or Placement.from_config(cfg)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path)
        self.train_loader = self.build_train_loader()
        self.val_dataset = build_prompt_dataset(cfg.data, self.tokenizer, "val")
        t = cfg.trainer
        self.total_steps = t.total_steps or t.total_epochs * len(self.train_loader)
        self.global_step = 0
        self.timers = Timers()
        self.rule_reward = RuleReward(cfg.reward) if cfg.reward.kind == "rule" else None
        self.tracker = None
        self.owns_groups = groups is None
        if groups is None:
            start_ray(cfg, self.placement.num_devices)
            self.groups, self.pools = build_worker_groups(cfg, self.placement, self.roles())
        else:
            missing = [r for r in self.roles() if r not in groups]
            if missing:
                raise ValueError(
                    f"{self.name}: the given worker groups lack roles {missing} (have {sorted(groups)})"
                )
            self.groups, self.pools = dict(groups), []

    # ---- what a subclass defines -------------------------------------------------------------------
    def roles(self) -> dict[str, dict]:
        """role -> extra init kwargs (see placement.ROLES)."""
        raise NotImplementedError

    def build_train_loader(self) -> StatefulDataLoader:
        ds = build_prompt_dataset(self.cfg.data, self.tokenizer, "train")
        if ds is None:
            raise ValueError("no training data: set data.train_files or data.dataset")
        return StatefulDataLoader(
            ds, self.cfg.data.train_batch_size, shuffle=self.cfg.data.shuffle, seed=self.cfg.data.seed
        )

    def train_step(self, batch: Batch) -> tuple[Batch, dict]:
        """One iteration on a batch from the loader -> (finished batch, metrics)."""
        raise NotImplementedError

    def extra_state(self) -> dict:
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    @property
    def optim_steps_per_step(self) -> int:
        """Optimizer steps per training step (mini-batches x epochs), for LR schedules."""
        return 1

    # ---- groups ---------------------------------------------------------------------------------------
    @property
    def actor(self):
        return self.groups["actor_rollout"]

    def group(self, role: str):
        return self.groups.get(role)

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        """Train for trainer.total_steps (validating and checkpointing per trainer.*); returns the
        per-step metrics (validation metrics are merged into the step they follow)."""
        from hybridflow.logging import build_tracker

        self.maybe_resume()
        self.tracker = build_tracker(
            self.cfg, total_steps=self.total_steps, resume_step=self.global_step or None
        )
        history = []
        try:
            self._loop(history)
        finally:
            self.tracker.close()
        return history

    def _loop(self, history: list[dict]) -> None:
        t = self.cfg.trainer
        if t.val_before_train and self.global_step == 0:
            val = {**self.validate(), **self.timers.pop()}
            self.tracker.log(val, 0)
            history.append({"step": 0, **val})
        while self.global_step < self.total_steps:
            self.global_step += 1
            batch = self.train_loader.next_batch()
            batch.meta["global_step"] = self.global_step
            start = time.perf_counter()
            with self.timers("step"):
                batch, metrics = self.train_step(batch)
            metrics.update(throughput_metrics(batch, time.perf_counter() - start, self.placement.num_devices))
            last = self.global_step == self.total_steps
            if (t.val_every and self.global_step % t.val_every == 0) or last:
                metrics.update(self.validate())
            if (t.save_every and self.global_step % t.save_every == 0) or last:
                self.save_checkpoint()
            metrics.update(self.timers.pop())  # the step's phases, then validate / save_checkpoint
            self.tracker.log(metrics, self.global_step)
            history.append({"step": self.global_step, **metrics})

    # ---- validation ---------------------------------------------------------------------------------
    def validate(self) -> dict:
        """Generate for every validation prompt (rollout.val sampling) and score: val/{data_source}/acc@1
        (mean@n when rollout.val.n > 1) with a rule reward, val/{data_source}/reward with a reward model."""
        if self.val_dataset is None:
            return {}
        v = self.cfg.rollout.val
        sampling = {"n": v.n, "temperature": v.temperature, "top_k": v.top_k, "top_p": v.top_p}
        size = self.cfg.data.val_batch_size or len(self.val_dataset)
        per_source, rows = defaultdict(list), []
        with self.timers("validate"):
            for start in range(0, len(self.val_dataset), size):
                samples = [
                    self.val_dataset[i] for i in range(start, min(start + size, len(self.val_dataset)))
                ]
                out = self.actor.generate_sequences(self.val_dataset.collate(samples), sampling=sampling)
                scores = self.val_scores(out)
                for src, s in zip(out["data_source"], scores.tolist()):
                    per_source[src].append(s)
                rows += self._generation_rows(
                    out, scores, self.cfg.trainer.val_generations_to_log - len(rows)
                )
        if self.tracker is not None and rows:
            self.tracker.log_generations(rows, self.global_step)
        metric = "acc@1" if v.n == 1 else f"mean@{v.n}"
        if self.rule_reward is None:
            metric = "reward"
        out = {f"val/{src}/{metric}": float(np.mean(s)) for src, s in per_source.items()}
        out["val/reward/mean"] = float(np.mean([s for ss in per_source.values() for s in ss]))
        return out

    def val_scores(self, batch: Batch):
        if self.rule_reward is not None:
            return self.rule_reward(batch)[0]
        return self.groups["reward"].compute_reward(batch)["rm_scores"]

    @staticmethod
    def _generation_rows(batch: Batch, scores, limit: int) -> list[dict]:
        keys = [k for k in ("prompt_text", "response_text", "ground_truth") if k in batch]
        return [
            {**{k: str(batch[k][i]) for k in keys}, "score": float(scores[i])}
            for i in range(max(0, min(limit, len(batch))))
        ]

    # ---- checkpoints ----------------------------------------------------------------------------------
    def checkpoint_dir(self, step: int | None = None) -> str:
        return os.path.join(
            self.cfg.run_dir, "checkpoints", f"global_step_{self.global_step if step is None else step}"
        )

    def trainable_groups(self) -> dict:
        return {r: self.groups[r] for r in ("actor_rollout", "critic", "cost_critic") if r in self.groups}

    def save_checkpoint(self) -> str:
        path = self.checkpoint_dir()
        with self.timers("save_checkpoint"):
            for g in self.trainable_groups().values():
                g.save_checkpoint(path)
            state = {"global_step": self.global_step, "algorithm": self.name,
                     "loader": self.train_loader.state_dict(), "extra": self.extra_state()}  # fmt: skip
            with open(os.path.join(path, "trainer_state.json"), "w") as f:
                json.dump(state, f, indent=1)
        return path

    def load_checkpoint(self, path: str) -> None:
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        for g in self.trainable_groups().values():
            g.load_checkpoint(path)
        self.global_step = int(state["global_step"])
        self.train_loader.load_state_dict(state["loader"])
        self.load_extra_state(state.get("extra", {}))

    def latest_checkpoint(self) -> str | None:
        root = os.path.join(self.cfg.run_dir, "checkpoints")
        steps = [int(m.group(1)) for d in (os.listdir(root) if os.path.isdir(root) else [])
                 if (m := re.fullmatch(r"global_step_(\d+)", d)) and os.path.isfile(os.path.join(root, d, "trainer_state.json"))]  # fmt: skip
        return os.path.join(root, f"global_step_{max(steps)}") if steps else None

    def maybe_resume(self) -> None:
        resume = self.cfg.trainer.resume
        path = self.latest_checkpoint() if resume == "auto" else (None if resume == "never" else resume)
        if path is not None and self.global_step == 0:
            self.load_checkpoint(path)

    # ---- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.rule_reward is not None:
            self.rule_reward.close()
        if self.owns_groups:
            shutdown(self.groups, self.pools)
        self.groups, self.pools = {}, []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
