"""The phases every online RL driver is made of, as small methods on the controller.

A driver's `train_step` strings them together (ppo.py is the full list); variants override one or
two phases (grpo.py: advantages; remax.py: generation + advantages; safe_rlhf.py: values, reward,
critic update, advantages). Each phase takes the batch and returns it with new fields:

  generate           prompts -> rollouts (responses, response_mask, rollout_log_probs, response_text),
                     from the run's rollout source (sources/: synchronous, or one step ahead), which
                     says where old log-probs come from and may have scored the frozen models already
  old_log_probs      old_log_probs: the rollout's, the update's own forward's, or an actor forward
                     (sources/base.py `old_log_prob_source` says which and why each is exact)
  ref_log_probs      ref_log_probs, when a KL term needs them
  values             values from the critic
  reward             scores (B,) from a rule in the driver, or the reward model's rm_scores
  compute_advantages token_level_scores / _rewards (KL-shaped if kl.in_reward), advantages, returns:
                     the class's `advantage_fn` run by experience.make_experience on the actor's rank 0
  update_critic / update_actor   the worker groups' training loops; return metrics

Every phase after generation is non-blocking (docs/design.md §3): it issues its group call as a
future and returns at once, so phases on different pools run at the same time, and each consumer
takes its inputs from the object store, never through the driver (experience.py). The driver waits
in `finish`, for the updates' metrics and the experience's; trainer.overlap_phases=false makes every
phase wait for its own calls instead (the sequential baseline; the same numbers).
"""

from __future__ import annotations

from hybridflow.algorithms import build_kl_controller
from hybridflow.batch import Batch
from hybridflow.config.rollout_pool import FROZEN_ROLES
from hybridflow.trainers.base import Trainer
from hybridflow.trainers.experience import Pending, make_experience
from hybridflow.trainers.perf import request_memory_stats
from hybridflow.trainers.sources import OldLogProbs, source_class

CRITIC_ROLES = ("critic", "cost_critic")  # trained models whose step reads them before their update
# phases issued together; timing_s/overlap/<section> is the wall time of each (docs/metrics.md)
OVERLAP_SECTIONS = {
    "experience": ("old_log_prob", "values", "ref", "reward", "adv"),
    "update": ("update_critic", "update_actor"),
}


class RLTrainer(Trainer):
    """Shared phases of online RL. The class's `spec` (config/algorithms.py) says which models run."""

    def __init__(self, config, placement=None, groups=None):
        super().__init__(config, placement, groups)
        k = self.cfg.algorithm.kl
        self.kl_ctrl = build_kl_controller(k.controller, k.coef, k.target, k.horizon)
        self.metrics: dict = {}
        self.updates: list = []  # this step's update futures (their metrics are read in finish)
        self.timers.wait_each_phase = not self.cfg.trainer.overlap_phases
        self.source = source_class(self.cfg)(self)  # where each step's batch comes from (sources/)

    # ---- setup ----------------------------------------------------------------------------------------
    @property
    def uses_ref(self) -> bool:
        return self.spec.uses_reference(self.cfg)

    @property
    def num_mini_batches(self) -> int:
        return self.cfg.actor.num_mini_batches

    @property
    def optim_steps_per_step(self) -> int:
        return self.num_mini_batches * self.cfg.actor.ppo_epochs

    def roles(self) -> dict[str, dict]:
        return {**super().roles(), **source_class(self.cfg).roles}

    def role_kwargs(self) -> dict[str, dict]:
        c = self.cfg.critic
        critic = {"total_optim_steps": self.total_steps * c.num_mini_batches * c.ppo_epochs}
        actor = {"total_optim_steps": self.total_steps * self.optim_steps_per_step}
        return {"actor_rollout": actor, "critic": critic, "cost_critic": critic}

    @property
    def critic(self):
        return self.groups["critic"]

    @property
    def ref(self):
        return self.groups["ref"]

    # ---- phases ---------------------------------------------------------------------------------------
    def generate(self, prompts: Batch) -> Pending:
        step = self.source.batch(prompts)
        self.metrics.update(step.metrics)  # reshard/*, any figures the engine adds, the source's (sync/*)
        self.metrics["rollout/policy_lag"] = float(step.policy_lag)
        return Pending(step)

    def old_log_probs(self, batch: Pending) -> Pending:
        """Old log-probs from where the source said; the choice rides in meta.old_log_probs_source to the
        update (workers/actor.py), which with "update" takes them from its own forward, detached."""
        source = OldLogProbs(batch.step.old_log_probs)
        batch.meta.old_log_probs_source = source.value
        if source is OldLogProbs.ROLLOUT:
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif source is OldLogProbs.ACTOR:
            batch.add(self.actor.compute_log_prob.future(batch.local))
        return batch

    def ref_log_probs(self, batch: Pending) -> Pending:
        return self.scored_output("ref", "compute_ref_log_prob", batch) if self.uses_ref else batch

    def chained_on_rollout(self) -> list[str]:
        """The models a synchronous source issues with the generation, on its output, those the placement
        built a group for: the frozen ones (a reward or cost model where no rule scores; the reference
        where the algorithm reads it, which a LoRA run's actor group also stands in for) and the critics,
        whose weights stay as they are until this step's update. None in the sequential baseline
        (trainer.overlap_phases=false: each phase in the driver's order)."""
        if not self.cfg.trainer.overlap_phases:
            return []
        frozen = [r for r in FROZEN_ROLES if r in self.groups and (r != "ref" or self.uses_ref)]
        return [*frozen, *(r for r in CRITIC_ROLES if r in self.groups)]

    def scored_output(self, role: str, method: str, batch: Pending) -> Pending:
        """Model `role`'s output for `batch`: the parts the source already issued (chained on the
        generation, in row order), else a call of `method` on the role's own group now."""
        parts = batch.step.scored.pop(role, None)
        for part in parts if parts is not None else [getattr(self.groups[role], method).future(batch.local)]:
            batch.add(part)
        return batch

    def values(self, batch: Pending) -> Pending:
        return self.scored_output("critic", "compute_values", batch)

    def reward(self, batch: Pending) -> Pending:
        """Sequence scores: a rule runs here in the driver (it needs the responses, which the driver
        holds), while the phases issued before it run on their groups; a reward model is a future."""
        if self.rule_reward is None:
            return self.scored_output("reward", "compute_reward", batch)
        batch["scores"], metrics = self.score(batch.local)
        self.metrics.update(metrics)
        return batch

    advantage_fn = None  # (batch, algorithm config, state) -> metrics; adds advantages and returns

    def advantage_state(self) -> dict:
        """Driver-side state the advantage function reads (Safe-RLHF: the Lagrange multiplier)."""
        return {}

    def compute_advantages(self, batch: Pending) -> Pending:
        """Issue make_experience on the actor's rank 0, fed by the rollout and every phase's future."""
        fn, kl = type(self).advantage_fn, self.kl_ctrl.value
        batch.experience = self.actor.apply.future(
            make_experience, fn, self.cfg.algorithm, kl, self.advantage_state(), *batch.rollout_parts(),
            *batch.parts,
        )  # fmt: skip
        return batch

    def update_critic(self, batch: Pending) -> None:
        self.updates.append(self.critic.update_critic.future(batch.experience))

    def update_actor(self, batch: Pending) -> None:
        self.updates.append(self.actor.update_actor.future(batch.experience))
        self.source.note_update(self.updates[-1])

    def finish(self, batch: Pending) -> tuple[Pending, dict]:
        """Wait for the step: its calls' timing, the updates' metrics and the experience's (data
        metrics, KL); the adaptive KL controller moves by this step's KL."""
        updates, self.updates = self.updates, []
        self.memory_pending = request_memory_stats(self.groups)  # rides behind the updates (trainers/perf.py)
        self.timers.collect(OVERLAP_SECTIONS)
        metrics, self.metrics = self.metrics, {}
        for fut in updates:
            metrics.update(fut.get())
        info = next(c.info for c in batch.experience.calls() if c.info is not None)
        metrics.update(info)
        if "actor/reward_kl_penalty" in info:
            self.kl_ctrl.update(info["actor/reward_kl_penalty"], len(batch))
        self.after_experience(info)
        return batch, metrics

    def after_experience(self, metrics: dict) -> None:
        """Read back driver-side state the advantage phase updated (Safe-RLHF: lambda)."""

    def next_prompts(self) -> Batch:
        return self.source.prompts(self.global_step)

    # ---- state ------------------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.updates = []  # a restart (lifecycle.py) drops the calls of the step that failed
        self.memory_pending = None
        self.source.reset()  # a restart or a resume: what was in flight is gone (load_checkpoint restores it)
        if "kl_ctrl" in state:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def save_driver_parts(self, directory) -> None:
        self.source.save(directory)

    def load_checkpoint(self, path) -> None:
        super().load_checkpoint(path)
        self.source.load(path)
