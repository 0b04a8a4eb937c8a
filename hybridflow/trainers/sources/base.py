"""The rollout source interface, what the RL driver asks for each step's batch, and the synchronous source
(docs/design.md, "Rollout sources").

The driver (trainers/rl.py) draws a step's prompts with `prompts(step)` and takes its rollouts with
`batch(prompts)`; everything about *when and where* they were generated stays behind these calls: the
pools, the weight sync, the policy lag and the batch in flight across steps (and across checkpoints:
`save` / `load`). The answer is a `StepBatch`: the rollout Batch, the outputs the source already issued
for it (models scoring the rollout alone, chained on the generation), where the update takes old
log-probs, and the lag.

Sources: `SynchronousSource` below (the paper's schedule: generate on the actor's own 3D-HybridEngine)
and ahead.py (trainer.rollout_ahead=1: step k+1 generated on a pool of its own during step k). A partial
or fully asynchronous source is another subclass: it keeps more than one `InFlight`, sets
`on_policy = False` and reports its lag; a "generate until the batch is filled" loop calls its
`batch` more than once for one step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta
from hybridflow.checkpoint import atomic_write_text
from hybridflow.controller import Future
from hybridflow.workers.common import computes_in_fp32

IN_FLIGHT_PART = "rollout_ahead"  # the checkpoint part holding the batch in flight (its name since v1)
# a model's method scoring a rollout, and the phase its time is reported under (timing_s/<phase>): the
# frozen models, and the critics (whose values a synchronous step reads before their update)
SCORING = {"ref": ("compute_ref_log_prob", "ref"), "reward": ("compute_reward", "reward"),
           "cost": ("compute_reward", "reward"), "critic": ("compute_values", "values"),
           "cost_critic": ("compute_values", "values")}  # fmt: skip


class OldLogProbs(str, Enum):
    """Where a step's old log-probs (pi_old of the PPO ratio) come from (`old_log_prob_source`)."""

    ROLLOUT = "rollout"  # the rollout's own log-probs
    UPDATE = "update"  # the update's own forward, detached
    ACTOR = "actor"  # a separate actor forward before the update


def old_log_prob_source(cfg, rollout_exact: bool = True, on_policy: bool | None = None) -> OldLogProbs:
    """Where a step's old log-probs come from; every answer is exact. `on_policy`: the source samples
    each batch from the weights the update starts from (None: the config's schedule, trainer.rollout_ahead=0).

    ROLLOUT: the rollout's own log-probs. The actor's update is one optimizer step (ppo_epochs 1, one
             mini-batch) on a batch sampled from the current weights (on policy), computed in fp32
             (under bf16 the KV-cached decode rounds differently from the training forward) by an
             engine whose log-probs follow the training convention (`rollout_log_probs_exact`: vLLM's
             under top-k/top-p do not, rollout/vllm_engine.py). verl's shortcut; free, and
             actor/ppo_kl then measures the rollout-vs-training mismatch (rollout/log_prob_diff_*
             measure it under every source: workers/losses.py, docs/metrics.md).
    UPDATE:  the update's own forward, detached. With ONE optimizer step the weights do not move
             until the step's end (gradient-accumulation micro-batches only add up gradients), so
             pi_old is exactly the policy that forward runs: its log-probs, detached, are the old
             ones (a separate forward repeats them up to its own micro-batches' rounding). Saves that
             forward (bf16, vLLM with top-k/top-p, and a batch sampled a step earlier, whose IS weight
             becomes min(exp(logp - behaviour), cap)). Needs nothing before the update to read old
             log-probs: KL in the reward (algorithm.kl.in_reward) does, in the advantage phase. No
             other driver does (GRPO, RLOO, ReMax, REINFORCE++ read scores; PPO / Safe-RLHF values
             and scores).
    ACTOR:   a separate actor forward before the update (several optimizer steps: the later
             mini-batches' weights have moved; or KL in the reward without ROLLOUT).
    """
    a = cfg.actor
    if a.ppo_epochs != 1 or a.num_mini_batches != 1:
        return OldLogProbs.ACTOR
    if on_policy is None:
        on_policy = not cfg.trainer.rollout_ahead
    fp32 = computes_in_fp32(cfg.model.dtype, cfg.resources.device)
    if on_policy and fp32 and rollout_exact:
        return OldLogProbs.ROLLOUT
    return OldLogProbs.ACTOR if cfg.algorithm.kl.in_reward else OldLogProbs.UPDATE


@dataclass
class StepBatch:
    """What a source hands the driver for one step.

    rollout:       prompts + responses, response_mask, rollout_log_probs, response_text (B rows)
    scored:        role (a SCORING key) -> its output for these rows, already issued by the source
                   (Futures, or Batches restored from a checkpoint), in row order; a role not listed
                   is scored by the driver on its own group
    old_log_probs: where the update takes pi_old (`old_log_prob_source`)
    policy_lag:    actor updates between the weights that sampled `rollout` and those it trains from
    metrics:       the source's own (reshard/*, rollout/*, sync/*)
    generated:     the generation's Future whose whole output `rollout` is (a synchronous step's): later
                   calls take the rows from the object store, not from the driver's copy; None where the
                   driver assembled them (a checkpoint's batch, DAPO's kept groups, one step ahead)
    """

    rollout: Batch
    scored: dict[str, list[Future | Batch]]
    old_log_probs: OldLogProbs
    policy_lag: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    generated: Future | None = None


@dataclass
class InFlight:
    """A batch issued for a later step: its prompts, the generation and the frozen models' scoring
    (Futures while running, Batches once fetched or restored), the weight version that sampled it, and
    with the reference's rows split between pools (ahead.py) the rows the rollout pool scores."""

    step: int
    version: int
    prompts: Batch
    rollouts: Future | Batch
    frozen: dict[str, Future | Batch] = field(default_factory=dict)
    ref_rows: int | None = None

    @property
    def restored(self) -> bool:
        """Fetched (a checkpoint was written or read): nothing about its generation is measured."""
        return not isinstance(self.rollouts, Future)

    def save(self, directory: Path) -> None:
        """Write into checkpoint directory `directory`/rollout_ahead (safetensors + JSON, no pickle),
        waiting for it. The rollouts stay fetched (the next step uses them as they are); the frozen
        outputs stay Futures in memory, since a reference part of some rows must reach the advantage
        phase as a Future (the phase splits its Batch arguments whole)."""
        self.rollouts = _result(self.rollouts)
        out = Path(directory) / IN_FLIGHT_PART
        out.mkdir(parents=True, exist_ok=True)
        save_batch(self.prompts, out / "prompts")
        save_batch(self.rollouts, out / "rollouts")
        for role, scores in self.frozen.items():
            save_batch(_result(scores), out / f"scores_{role}")
        atomic_write_text(out / "state.json", json.dumps({"step": self.step, "version": self.version}))

    @classmethod
    def load(cls, directory: Path) -> InFlight | None:
        """The batch in flight saved in checkpoint `directory` (None: there was none). A frozen output of
        only some rows (the reference split between pools) cannot travel beside the whole batch as a
        Batch, so it is dropped and those rows scored again; `ref_rows` is what the rollout pool scored."""
        part = Path(directory) / IN_FLIGHT_PART
        if not part.is_dir():
            return None
        state = json.loads((part / "state.json").read_text())
        rollouts = load_batch(part / "rollouts")
        frozen = {}
        for scores in sorted(part.glob("scores_*.json")):
            out = load_batch(scores.with_suffix(""))
            if len(out) == len(rollouts):
                frozen[scores.stem.removeprefix("scores_")] = out
        prompts = load_batch(part / "prompts")
        ref_rows = len(rollouts) if "ref" in frozen else 0
        return cls(int(state["step"]), int(state["version"]), prompts, rollouts, frozen, ref_rows)


class RolloutSource:
    """Where the driver's batches come from. `trainer` is the RLTrainer served (its config, groups,
    loader, timers). Subclasses define `batch`; a batch restored from a checkpoint (`in_flight`) is
    served for its step whatever the source (a run resumed with another schedule trains on it first)."""

    on_policy = True  # every batch is sampled from the weights its update starts from
    times_generation = (
        True  # timing_s/gen is the generation itself (else the wait for a batch made elsewhere)
    )
    roles: dict[str, dict] = {}  # worker groups the source needs besides the algorithm's (placement.ROLES)

    def __init__(self, trainer):
        self.trainer = trainer
        self.in_flight: InFlight | None = None

    def prompts(self, step: int) -> Batch:
        """The prompts of `step`: those drawn earlier for it (a batch in flight), else the loader's next."""
        if self.in_flight is not None and self.in_flight.step == step:
            return self.in_flight.prompts
        return self.trainer.train_loader.next_batch()

    def batch(self, prompts: Batch) -> StepBatch:
        """The step's rollouts for `prompts` (meta.global_step is the step)."""
        raise NotImplementedError

    def note_update(self, update: Future) -> None:
        """The actor's update of this step, issued (a source balancing its pools measures it)."""

    def save(self, directory: Path) -> None:
        """Write what is in flight into checkpoint `directory` (waiting for it)."""
        if self.in_flight is not None:
            self.in_flight.save(directory)

    def load(self, directory: Path) -> None:
        """Restore what was in flight at checkpoint `directory`."""
        self.in_flight = InFlight.load(directory)

    def reset(self) -> None:
        """Forget what is in flight (its groups are gone: a restart)."""
        self.in_flight = None

    # ---- for subclasses --------------------------------------------------------------------------------
    def chain_on_rollout(self, role: str, rows: Future) -> Future:
        """Model `role` scoring `rows` of a generation still running (its Future) on its own group, issued
        now: its ranks fetch their rows of the generation themselves and start when it ends, so the
        rollout makes no round trip through the driver on its way to them."""
        method, phase = SCORING[role]
        with self.trainer.timers.phase(phase):  # its workers' busy time, under the phase it stands in for
            return getattr(self.trainer.groups[role], method).future(rows)

    def take_in_flight(self, step: int) -> InFlight | None:
        """The batch in flight issued for `step`, handed over (None: nothing was issued for it)."""
        p = self.in_flight
        if p is None or p.step != step:
            return None
        self.in_flight = None
        return p

    def step_batch(
        self, rollout: Batch, prompts: Batch, scored: dict, policy_lag: int, metrics: dict,
        generated: Future | None = None,
    ) -> StepBatch:  # fmt: skip
        """The StepBatch of `rollout`: the prompts' meta on it, the generation's metrics moved off it."""
        metrics = {**rollout.meta.pop_metrics(), **metrics}
        rollout.meta = rollout.meta.union(prompts.meta)
        exact = rollout.meta.rollout_log_probs_exact is not False
        old = old_log_prob_source(self.trainer.cfg, exact, self.on_policy)
        return StepBatch(rollout, scored, old, policy_lag, metrics, generated)


class SynchronousSource(RolloutSource):
    """The paper's schedule. Each step's batch is generated from the current weights on the actor's own
    ranks (the 3D-HybridEngine switches them from training to generation and back, workers/actor.py),
    so it is on policy (lag 0) and no other pool or weight sync exists. The models that score the rollout
    alone are chained on the generation (`chain_on_rollout`): the frozen ones, and the critics, whose
    weights stay as they are until this step's update."""

    def batch(self, prompts: Batch) -> StepBatch:
        step = prompts.meta.global_step
        restored = self.take_in_flight(step)  # a one-step-ahead run's checkpoint, resumed synchronously
        if restored is not None:
            frozen = {r: [b] for r, b in restored.frozen.items()}
            return self.step_batch(restored.rollouts, prompts, frozen, step - 1 - restored.version, {})
        rollout = self.trainer.actor.generate_sequences.future(prompts)
        scored = {role: [self.chain_on_rollout(role, rollout)] for role in self.trainer.chained_on_rollout()}
        return self.step_batch(rollout.get(), prompts, scored, 0, {}, generated=rollout)


def _result(x: Future | Batch) -> Batch:
    return x.get() if isinstance(x, Future) else x


def save_batch(batch: Batch, stem: Path) -> None:
    """A Batch as stem.safetensors (tensors) + stem.json (non-tensor fields and meta): nothing pickled."""
    from safetensors.torch import save_file

    from hybridflow.checkpoint.trainer_state import _to_json

    save_file({k: v.contiguous() for k, v in batch.tensors.items()}, f"{stem}.safetensors")
    fields = {
        "non_tensors": {k: v.tolist() for k, v in batch.non_tensors.items()},
        "meta": batch.meta.to_dict(),
    }
    atomic_write_text(Path(f"{stem}.json"), json.dumps(fields, default=_to_json))


def load_batch(stem: Path) -> Batch:
    from safetensors.torch import load_file

    fields = json.loads(Path(f"{stem}.json").read_text())
    return Batch(load_file(f"{stem}.safetensors"), fields["non_tensors"], BatchMeta.from_dict(fields["meta"]))
