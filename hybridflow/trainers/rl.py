"""The phases every online RL driver is made of, as small methods on the controller.

A driver's `train_step` strings them together (ppo.py is the full list); variants override one or
two phases (grpo.py: advantages; remax.py: generation + advantages; safe_rlhf.py: values, reward,
critic update, advantages). Each phase takes the batch and returns it with new fields:

  generate           prompts -> rollouts (responses, response_mask, rollout_log_probs, response_text);
                     with trainer.rollout_ahead=1 the batch the rollout pool generated a step ahead
                     (rollout_ahead.py), and the next step's generation issued
  old_log_probs      old_log_probs: the rollout's, the update's own forward's, or an actor forward
                     (`old_log_prob_source` says which and why each is exact)
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
from hybridflow.trainers.base import Trainer
from hybridflow.trainers.experience import Pending, make_experience
from hybridflow.trainers.rollout_ahead import RolloutAhead
from hybridflow.workers.common import computes_in_fp32

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
        self.ahead = RolloutAhead(self)

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
        roles = super().roles()
        if self.cfg.trainer.rollout_ahead:  # a rollout-only worker group on a pool of its own
            roles["rollout"] = {}
        return roles

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
    def generate(self, prompts: Batch) -> Batch:
        if self.ahead.serves(self.global_step):
            batch = self.ahead.generate(prompts)
        else:
            batch = self.actor.generate_sequences(prompts)
        self.metrics.update(batch.meta.pop_metrics())  # reshard/*, and any figures the engine adds
        batch.meta = batch.meta.union(prompts.meta)
        return batch

    def old_log_probs(self, batch: Batch | Pending) -> Pending:
        """Old log-probs by `old_log_prob_source`; the choice rides in meta.old_log_probs_source to the update
        (workers/actor.py), which with "update" takes them from its own forward, detached."""
        batch = _pending(batch)
        source = old_log_prob_source(self.cfg, batch.meta.rollout_log_probs_exact is not False)
        batch.meta.old_log_probs_source = source
        if source == "rollout":
            batch["old_log_probs"] = batch["rollout_log_probs"]
        elif source == "actor":
            batch.add(self.actor.compute_log_prob.future(batch.local))
        return batch

    def ref_log_probs(self, batch: Batch | Pending) -> Pending:
        batch = _pending(batch)
        if not self.uses_ref:
            return batch
        # resources.frozen_pool=both: rows scored on the rollout pool, then the rest on the training pool
        parts = self.ahead.ref_parts(batch.local)
        for part in (
            parts if parts is not None else [self.frozen_output("ref", "compute_ref_log_prob", batch)]
        ):
            batch.add(part)
        return batch

    def frozen_output(self, role: str, method: str, batch: Pending):
        """A frozen model's output for `batch`: scored a step ahead on the rollout pool
        (rollout_ahead.py), else a call of `method` on the role's own group now."""
        ahead = self.ahead.scored(role)
        return ahead if ahead is not None else getattr(self.groups[role], method).future(batch.local)

    def values(self, batch: Batch | Pending) -> Pending:
        batch = _pending(batch)
        return batch.add(self.critic.compute_values.future(batch.local))

    def reward(self, batch: Batch | Pending) -> Pending:
        """Sequence scores: a rule runs here in the driver (it needs the responses, which the driver
        holds), while the phases issued before it run on their groups; a reward model is a future."""
        batch = _pending(batch)
        if self.rule_reward is None:
            return batch.add(self.frozen_output("reward", "compute_reward", batch))
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
            make_experience, fn, self.cfg.algorithm, kl, self.advantage_state(), batch.local, *batch.parts
        )
        return batch

    def update_critic(self, batch: Pending) -> None:
        self.updates.append(self.critic.update_critic.future(batch.experience))

    def update_actor(self, batch: Pending) -> None:
        self.updates.append(self.actor.update_actor.future(batch.experience))
        self.ahead.note_update(self.updates[-1])

    def finish(self, batch: Pending) -> tuple[Pending, dict]:
        """Wait for the step: its calls' timing, the updates' metrics and the experience's (data
        metrics, KL); the adaptive KL controller moves by this step's KL."""
        updates, self.updates = self.updates, []
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
        ahead = self.ahead.next_prompts(self.global_step)
        return ahead if ahead is not None else super().next_prompts()

    # ---- state ------------------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.updates = []  # a restart (lifecycle.py) drops the calls of the step that failed
        self.ahead.reset()  # a restart or a resume: what was in flight is gone (load_checkpoint restores it)
        if "kl_ctrl" in state:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def save_driver_parts(self, directory) -> None:
        self.ahead.save(directory)

    def load_checkpoint(self, path) -> None:
        super().load_checkpoint(path)
        self.ahead.load(path)


def old_log_prob_source(cfg, rollout_exact: bool = True) -> str:
    """Where a step's old log-probs (pi_old of the PPO ratio) come from; every answer is exact.

    "rollout":  the rollout's own log-probs. The actor's update is one optimizer step (ppo_epochs 1, one
                mini-batch) on a batch sampled from the current weights (synchronous), computed in fp32
                (under bf16 the KV-cached decode rounds differently from the training forward) by an
                engine whose log-probs follow the training convention (`rollout_log_probs_exact`: vLLM's
                under top-k/top-p do not, rollout/vllm_engine.py). verl's shortcut; free, and
                actor/ppo_kl then measures the rollout-vs-training mismatch (rollout/log_prob_diff_*
                measure it under every source: workers/gap_meter.py, docs/metrics.md).
    "update":   the update's own forward, detached. With ONE optimizer step the weights do not move
                until the step's end (gradient-accumulation micro-batches only add up gradients), so
                pi_old is exactly the policy that forward runs: its log-probs, detached, are the old
                ones (a separate forward repeats them up to its own micro-batches' rounding). Saves that
                forward (bf16, vLLM with top-k/top-p, and trainer.rollout_ahead=1, whose batch was
                sampled a step earlier: its IS weight becomes min(exp(logp - behaviour), cap)).
                Needs nothing before the update to read old log-probs: KL in the reward
                (algorithm.kl.in_reward) does, in the advantage phase. No other driver does
                (GRPO, RLOO, ReMax, REINFORCE++ read scores; PPO / Safe-RLHF values and scores).
    "actor":    a separate actor forward before the update (several optimizer steps: the later
                mini-batches' weights have moved; or KL in the reward without "rollout").
    """
    a = cfg.actor
    if a.ppo_epochs != 1 or a.num_mini_batches != 1:
        return "actor"
    fp32 = computes_in_fp32(cfg.model.dtype, cfg.resources.device)
    if not cfg.trainer.rollout_ahead and fp32 and rollout_exact:
        return "rollout"
    return "actor" if cfg.algorithm.kl.in_reward else "update"


def _pending(batch: Batch | Pending) -> Pending:
    return batch if isinstance(batch, Pending) else Pending(batch)
