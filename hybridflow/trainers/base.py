"""What every trainer shares: config -> Ray cluster, pools and worker groups, data, tracker; the step
loop with validation (validation.py) and checkpoint hooks. An algorithm only says what it needs (its `spec`, from
config/algorithms.py: the roles follow from it), what it trains on (`build_train_loader()`) and what
one step does (`train_step`).

    trainer = build_trainer(cfg)          # hybridflow/trainers/__init__.py
    history = trainer.fit()               # list of per-step metric dicts (also sent to the tracker)
    trainer.close()

Checkpoints go through hybridflow/checkpoint's CheckpointManager (run_dir/checkpoints/step_N, written
atomically, keep-last-K, a `latest` pointer): every trainable worker group writes its part (model,
optimizer shards of each rank, LR scheduler, per-rank RNG states, HF config; docs/checkpoints.md) and the driver adds
trainer_state.json (step, loader position, `extra_state`: KL coefficient / Lagrange multiplier, its
own RNG state). `trainer.resume=auto` continues from `latest`, and the resumed run repeats the
uninterrupted one exactly (tests/trainers/test_resume.py).

The run's life around the loop (lifecycle.py, docs/operations.md): the run directory is locked before
any worker starts, the checkpoint to resume is verified (SHA-256) and checked against this run's batch
and model, a finished run raises RunFinished; a dead worker or a failed collective restarts the worker
groups from the last checkpoint (trainer.max_restarts); a stop signal ends the loop after the step
with a checkpoint (Preempted).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hybridflow.agent import tool_schemas
from hybridflow.batch import Batch
from hybridflow.checkpoint import (
    CheckpointError,
    capture_rng_state,
    load_trainer_state,
    restore_rng_state,
    save_trainer_state,
)
from hybridflow.config import ConfigError, resolve_config, validate_config
from hybridflow.config.algorithms import AlgorithmSpec
from hybridflow.controller import WorkerError
from hybridflow.controller.future import hang_timeout
from hybridflow.controller.timers import Timers
from hybridflow.data import PromptDataset, StatefulDataLoader, build_prompt_dataset
from hybridflow.errors import RunStopped
from hybridflow.models import load_tokenizer
from hybridflow.rollout.factory import require_rollout_engine
from hybridflow.trainers import cluster_loss, lifecycle, supervised
from hybridflow.trainers.auto_placement import PromptLengths
from hybridflow.trainers.dump import batch_scores, generation_rows, write_generations
from hybridflow.trainers.lifecycle import start_ray
from hybridflow.trainers.metrics import throughput_metrics
from hybridflow.trainers.placement import Placement, build_worker_groups, shutdown, write_placement
from hybridflow.trainers.plan_metrics import plan_metrics
from hybridflow.trainers.run_dir import checkpoint_manager, claim_run_dir, resume_fingerprint
from hybridflow.trainers.validation import ValidationMixin
from hybridflow.workers import RuleReward
from hybridflow.workers.reward import check_reward_sources


def score_batch(batch: Batch, rule: RuleReward | None, model_group, key: str) -> tuple[torch.Tensor, dict]:
    """The one scoring path (training, validation, ReMax's baseline, Safe-RLHF's cost): a rule function
    run in the driver when `rule` is set, else the reward / cost model group's `compute_reward(batch)[key]`.
    -> (scores (B,), metrics: the rule executor's counts, none for a model)."""
    if rule is not None:
        return rule(batch)
    return model_group.compute_reward(batch)[key], {}


class Trainer(ValidationMixin):
    """Base of every algorithm's trainer. `config`: a HybridFlowConfig; `placement`: pools and roles
    (default: from resources.placement); `groups`: worker groups of another trainer to drive instead
    of starting new ones (e.g. comparing advantage estimators on the same workers) — their
    worker-side settings (models, actor/critic sections, KL loss) are the ones they were built with,
    and this trainer does not shut them down."""

    name = "base"
    offline = False  # SFT / DPO (offline.py): the training rows are targets, never scored by a reward
    owns_run_dir = True  # trains: locks the run directory and resumes from it (eval does neither)
    spec: AlgorithmSpec  # what the algorithm needs (config/algorithms.py): the one place that says it

    def __init__(self, config, placement: Placement | None = None, groups: dict | None = None):
        self.cfg = cfg = resolve_config(config)
        validate_config(cfg)
        require_rollout_engine(cfg)
        if cfg.trainer.rollout_data_dir and not self.spec.generation:
            raise ConfigError([f"trainer.rollout_data_dir: {self.name} samples no rollouts; remove it"])
        self.tokenizer = load_tokenizer(
            cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code
        )
        self.tools = tool_schemas(cfg.rollout.multi_turn)  # the chat template lists them in each prompt
        self.train_loader = self.build_train_loader()
        # placement=auto prices the passes at the loaded prompts' mean length (a pass over the dataset: only there)
        auto = placement is None and cfg.resources.placement == "auto"
        self.placement = placement or Placement.from_config(
            cfg, self.prompt_lengths() if auto else PromptLengths()
        )
        rule = cfg.reward.kind == "rule"
        self.val_dataset = build_prompt_dataset(cfg.data, self.tokenizer, "val", rule, self.tools)
        if cfg.trainer.val_only and self.val_dataset is None:
            raise ConfigError(["trainer.val_only: no validation data; set data.val_files or data.dataset"])
        if rule:  # a data_source no rule function scores: one line now, not in step 1's reward
            loader = None if self.offline else self.train_loader  # eval builds none
            check_reward_sources(cfg.reward, [getattr(loader, "dataset", None), self.val_dataset])
        trainer_cfg = cfg.trainer
        self.total_steps = trainer_cfg.total_steps or trainer_cfg.total_epochs * len(self.train_loader or ())
        self.global_step = self.skipped_in_a_row = 0
        self.ckpt = checkpoint_manager(cfg)
        self.timers = Timers()
        self.restarts, self.run_lock, self.resume_path = supervised.restarts_before(), None, None
        if self.owns_run_dir:
            claim_run_dir(self)
        self.rule_reward = RuleReward(cfg.reward, columns=self.reward_columns(), max_steps=self.total_steps,
                                      output_dir=cfg.run_dir) if rule else None  # fmt: skip
        self.tracker = None
        self.owns_groups = groups is None
        if groups is None:
            start_ray(cfg, self.placement.num_devices)
            self.groups, self.pools = build_worker_groups(cfg, self.placement, self.roles())
            if self.owns_run_dir:  # run_dir/placement.json: the pools and layouts this run built
                write_placement(cfg.run_dir, self.placement, self.groups)
        else:
            missing = [r for r in self.roles() if r not in groups]
            if missing:
                raise ValueError(
                    f"{self.name}: the given worker groups lack roles {missing} (have {sorted(groups)})"
                )
            self.groups, self.pools = dict(groups), []

    # ---- what a subclass defines -------------------------------------------------------------------
    def roles(self) -> dict[str, dict]:
        """role -> extra init kwargs (see placement.ROLES): the roles `spec` names for this config."""
        kwargs = self.role_kwargs()
        return {role: kwargs.get(role, {}) for role in self.spec.roles(self.cfg)}

    def role_kwargs(self) -> dict[str, dict]:
        """Extra init kwargs of some roles (e.g. the optimizer steps of the run, for LR schedules)."""
        return {}

    def build_train_loader(self) -> StatefulDataLoader:
        ds = build_prompt_dataset(
            self.cfg.data, self.tokenizer, "train", self.cfg.reward.kind == "rule", self.tools
        )
        if ds is None:
            raise ValueError("no training data: set data.train_files or data.dataset")
        return StatefulDataLoader(
            ds, self.cfg.data.train_batch_size, shuffle=self.cfg.data.shuffle, seed=self.cfg.data.seed
        )

    def prompt_lengths(self) -> PromptLengths:
        """The training prompts' mean and longest token counts (0: no prompt dataset loaded)."""
        ds = self.train_loader.dataset if self.train_loader is not None else None
        return PromptLengths.of(ds) if isinstance(ds, PromptDataset) else PromptLengths()

    def reward_columns(self) -> set[str] | None:
        """The training prompts' columns a reward function may ask for (None: not a prompt dataset)."""
        ds = self.train_loader.dataset if self.train_loader is not None else None
        return ds.reward_columns() if isinstance(ds, PromptDataset) else None

    def train_step(self, batch: Batch) -> tuple[Batch, dict]:
        """One iteration on a batch from the loader -> (finished batch, metrics)."""
        raise NotImplementedError

    def next_prompts(self) -> Batch:
        """The prompts of the step about to run (rl.py: the rollout source's, trainers/sources/)."""
        return self.train_loader.next_batch()

    def save_driver_parts(self, directory) -> None:
        """Write driver-side checkpoint parts besides trainer_state.json (rl.py: the source's batch in flight)."""

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

    # ---- the loop -----------------------------------------------------------------------------------
    def fit(self, stop_after: int | None = None) -> list[dict]:
        """Train for trainer.total_steps (validating and checkpointing per trainer.*); returns the
        per-step metrics of this call (validation metrics are merged into the step they follow).
        stop_after: end this call after that step, with a checkpoint there, as a preempted run would;
        the next fit (or a new run with resume=auto) continues from it. A dead worker or a failed
        collective restarts the groups from the last checkpoint, up to trainer.max_restarts times.
        trainer.val_only: validate the loaded weights once (logged at their step) and return."""
        from hybridflow.logging import build_tracker

        self._restore_point = self.maybe_resume()
        self.write_config()
        self._initial = (
            self.train_loader and self.train_loader.state_dict(),
            self.extra_state(),
            capture_rng_state(),
        )
        self._last_save = time.monotonic()
        history: list[dict] = []
        while True:
            step = self.global_step if self.global_step or self.restarts else None
            self.tracker = build_tracker(self.cfg, total_steps=self.total_steps, resume_step=step)
            try:
                with hang_timeout(self.cfg.trainer.hang_timeout_s if self.owns_groups else 0.0):
                    self._loop(history, min(stop_after or self.total_steps, self.total_steps))
                return history
            except Exception as e:
                if self.owns_groups and (lost := cluster_loss.lost_processes()):
                    raise cluster_loss.ClusterLost(lost, self.global_step) from e
                if not self._may_restart(e):
                    raise
                error = e
            finally:
                self.tracker.close()
            self._restart(error, history)

    def _may_restart(self, error: Exception) -> bool:
        return (
            lifecycle.is_recoverable(error)
            and self.owns_groups
            and self.restarts < self.cfg.trainer.max_restarts
            and not lifecycle.stop_requested()
        )

    def _restart(self, error: Exception, history: list[dict]) -> None:
        lifecycle.restart(self, error, history)

    def _loop(self, history: list[dict], stop: int) -> None:
        trainer_cfg = self.cfg.trainer
        if trainer_cfg.val_only or (trainer_cfg.val_before_train and self.global_step == 0 and not history):
            with _at_step(self.global_step, "validation at "):
                val = {**self.validate(), **self.timers.pop()}
            self.tracker.log(val, self.global_step)
            history.append({"step": self.global_step, **val})
        if (
            trainer_cfg.val_only
        ):  # verl's trainer.val_only: the weights loaded (initial or resumed) are validated
            return
        while self.global_step < stop:
            if signum := lifecycle.stop_requested():  # after the step (and its checkpoint) in flight
                preempted = lifecycle.Preempted(signum, self.global_step, self.latest_checkpoint())
                preempted.history = history  # Run.train (api.py) returns the rows trained so far
                raise preempted
            self.global_step += 1
            batch = self.next_prompts()
            batch.meta.global_step = self.global_step
            start = time.perf_counter()
            with self.timers("step"), _at_step(self.global_step):
                batch, metrics = self.train_step(batch)
            metrics.update(throughput_metrics(batch, time.perf_counter() - start, self.placement.num_devices))
            metrics.update(self.resource_metrics(batch))
            self._check_poisoned(metrics, history)
            if trainer_cfg.rollout_data_dir:
                rows = generation_rows(batch, batch_scores(batch))
                write_generations(trainer_cfg.rollout_data_dir, self.global_step, rows)
            last = self.global_step == self.total_steps
            if (trainer_cfg.val_every and self.global_step % trainer_cfg.val_every == 0) or last:
                with _at_step(self.global_step, "validation at "):
                    metrics.update(self.validate())
            by_time = (
                trainer_cfg.save_every_minutes
                and time.monotonic() - self._last_save >= 60 * trainer_cfg.save_every_minutes
            )
            stopping = lifecycle.stop_requested()
            if (
                (trainer_cfg.save_every and self.global_step % trainer_cfg.save_every == 0)
                or last
                or self.global_step == stop
                or by_time
                or stopping
            ):
                self.save_checkpoint(functools.partial(self._log_row, metrics, history))
            else:
                self._log_row(metrics, history)
            self._check_skipped(metrics)

    def _log_row(self, metrics: dict, history: list[dict]) -> None:
        """The step's metrics row; with a checkpoint, written just before the commit that makes the step
        resumable (a crash before it redoes the step, whose row a resumed JsonlBackend drops first)."""
        metrics.update(self.timers.pop())  # the step's phases, then validate / save_checkpoint
        if self.placement.plan is not None:  # the plan's predictions beside the measured stages
            metrics.update(plan_metrics(self.placement.plan, metrics, self.timers.driver_phases))
        metrics["trainer/restarts"] = self.restarts
        self.tracker.log(metrics, self.global_step)
        history.append({"step": self.global_step, **metrics})

    def _check_poisoned(self, metrics: dict, history: list[dict]) -> None:
        """Stop, the row logged, before a weight made non-finite by an update (an overflow) is saved."""
        bad = sorted(k for k, v in metrics.items() if k.endswith("/params_nonfinite") and v > 0)
        if bad:
            self._log_row(metrics, history)
            kept = self.latest_checkpoint()
            raise RunStopped(
                f"step {self.global_step}: the update made weights non-finite ({', '.join(bad)}); nothing of "
                f"it is saved and {kept.name if kept else 'no checkpoint'} is the last. Lower the learning "
                "rate or check the optimizer settings, then resume"
            )

    def _check_skipped(self, metrics: dict) -> None:
        """Stop after trainer.max_skipped_steps consecutive steps whose optimizer step was skipped (a
        non-finite gradient norm): naming the step and the non-finite metrics, never a silent run."""
        skipped = any(v > 0 for k, v in metrics.items() if k.endswith("/step_skipped"))
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        limit = self.cfg.trainer.max_skipped_steps
        if self.skipped_in_a_row >= limit:
            bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not np.isfinite(v))
            raise RunStopped(
                f"step {self.global_step}: the update was skipped in {limit} consecutive steps "
                f"(trainer.max_skipped_steps={limit}); non-finite: {', '.join(bad) or 'the gradient norm'}. "
                "Lower the learning rate or check the rewards; the last checkpoint is intact"
            )

    def write_config(self) -> Path:
        """run_dir/config.yaml: the resolved config of this run (read by `hybridflow eval` and the report)."""
        from hybridflow.checkpoint import atomic_write_text
        from hybridflow.config.cli import to_yaml

        path = Path(self.cfg.run_dir) / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, to_yaml(self.cfg) + "\n")
        return path

    def resource_metrics(self, batch: Batch) -> dict:
        """Peak memory per role and achieved FLOP/s (MFU on a known accelerator) per phase of this step."""
        from hybridflow.trainers.perf import step_resource_metrics

        return step_resource_metrics(self, batch)

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """Sequence scores (B,) from the run's reward (rule or model), and the rule's metrics."""
        return score_batch(batch, self.rule_reward, self.groups.get("reward"), "rm_scores")

    # ---- checkpoints ----------------------------------------------------------------------------------
    def trainable_groups(self) -> dict:
        return {r: self.groups[r] for r in ("actor_rollout", "critic", "cost_critic") if r in self.groups}

    def save_checkpoint(self, before_commit: Callable[[], None] = lambda: None) -> Path:
        """Checkpoint this step (atomic; `latest` moves on success; older ones pruned to keep_last).
        before_commit: run once it is written, before the commit (the step's row, with the save's time)."""
        m = self.cfg.model
        meta = {"algorithm": self.name, "tokenizer_dir": os.path.abspath(m.tokenizer_path or m.path),
                "fingerprint": resume_fingerprint(self.cfg)}  # fmt: skip
        start = time.perf_counter()

        def before_rename() -> None:
            self.timers.times["timing_s/save_checkpoint"] = time.perf_counter() - start
            before_commit()

        with self.ckpt.writing(self.global_step, meta=meta, before_commit=before_rename) as tmp:
            for g in self.trainable_groups().values():
                g.save_checkpoint(str(tmp))  # each writes tmp/<role>/ (a collective over its ranks)
            self.save_driver_parts(tmp)
            state = {"global_step": self.global_step, "algorithm": self.name, "loader": self.train_loader.state_dict(),
                     "extra": self.extra_state(), "rng": capture_rng_state()}  # fmt: skip
            save_trainer_state(tmp, state)
        self._restore_point, self._last_save = self.ckpt.step_dir(self.global_step), time.monotonic()
        supervised.report(checkpoint=str(self._restore_point))
        return self._restore_point

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore every trainable group, the loader position, extra_state and the driver's RNG."""
        state = load_trainer_state(path)
        if state.get("algorithm", self.name) != self.name:
            raise ValueError(
                f"checkpoint {path} was written by {state['algorithm']}, this run is {self.name}; "
                "set trainer.resume=never or another trainer.output_dir / experiment_name"
            )
        for g in self.trainable_groups().values():
            try:
                g.load_checkpoint(str(path))
            except WorkerError as e:  # e.g. shapes that do not fit this run's model
                last = e.remote_traceback.strip().splitlines()[-1] if e.remote_traceback.strip() else str(e)
                raise CheckpointError(f"could not load {path} into {g.name}: {last}") from e
        self.global_step = int(state["global_step"])
        self.train_loader.load_state_dict(state["loader"])
        self.load_extra_state(state.get("extra", {}))
        if "rng" in state:
            restore_rng_state(state["rng"])

    def latest_checkpoint(self) -> Path | None:
        return self.ckpt.latest()

    def maybe_resume(self) -> Path | None:
        """Load the checkpoint trainer.resume names (auto: the latest, if any; verified when this trainer
        was built); -> its path or None."""
        path = self.resume_path
        if path is None and not self.owns_run_dir:
            path = self.ckpt.resolve(
                self.cfg.trainer.resume, require=[*self.checkpoint_parts(), "trainer_state.json"]
            )
        if self.global_step != 0:
            return None
        if path is not None:
            self.load_checkpoint(path)
            supervised.report(checkpoint=str(path))
        if path is not None or self.restarts:
            what = str(path) if path is not None else "no checkpoint yet: the run's start"
            if self.restarts:  # a new driver after a lost cluster (supervisor.py)
                what = f"restart {self.restarts}/{self.cfg.trainer.max_restarts}: {what}"
            print(
                f"hybridflow train: resumed from step {self.global_step} ({what})",
                file=sys.stderr,
                flush=True,
            )
        return path

    def checkpoint_parts(self) -> list[str]:
        """The checkpoint parts (directories) this trainer's groups write: their role names."""
        trainable = ("actor_rollout", "critic", "cost_critic")
        return [{"actor_rollout": "actor"}.get(r, r) for r in self.roles() if r in trainable]

    # ---- teardown -------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.rule_reward is not None:
            self.rule_reward.close()
        if self.owns_groups:
            shutdown(self.groups, self.pools)
        self.groups, self.pools = {}, []
        if self.run_lock is not None:
            self.run_lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _at_step(step: int, what: str = ""):
    """A RunStopped raised inside (e.g. by the reward: reward.max_error_fraction) names the step."""
    try:
        yield
    except RunStopped as e:
        raise RunStopped(f"{what}step {step}: {e}") from None
