"""The phases every online RL driver is made of, as small methods on the controller.

A driver's `train_step` strings them together (ppo.py is the full list); variants override one or
two phases (grpo.py: advantages; remax.py: generation + advantages; safe_rlhf.py: values, reward,
critic update, advantages). Each phase takes the batch and returns it with new fields:

  generate           prompts -> rollouts (responses, response_mask, rollout_log_probs, response_text);
                     with trainer.rollout_ahead=1 the batch the rollout pool generated a step ahead
                     (rollout_ahead.py), and the next step's generation issued
  old_log_probs      old_log_probs: the rollout's own log-probs when the update is on-policy
                     (ppo_epochs == 1 and one mini-batch: the policy has not moved since sampling, so a
                     recompute would give the same numbers — verl's shortcut), else an actor forward
  ref_log_probs      ref_log_probs, when a KL term needs them
  values             values from the critic
  reward             scores (B,), token_level_scores, token_level_rewards (KL-shaped if kl.in_reward)
  update_critic / update_actor   the worker groups' training loops; return metrics
"""

from __future__ import annotations

from hybridflow.algorithms import apply_kl_penalty, build_kl_controller
from hybridflow.batch import Batch
from hybridflow.trainers.base import Trainer
from hybridflow.trainers.metrics import data_metrics
from hybridflow.trainers.rollout_ahead import RolloutAhead
from hybridflow.workers import token_level
from hybridflow.workers.common import computes_in_fp32


class RLTrainer(Trainer):
    """Shared phases of online RL. The class's `spec` (config/algorithms.py) says which models run."""

    def __init__(self, config, placement=None, groups=None):
        super().__init__(config, placement, groups)
        k = self.cfg.algorithm.kl
        self.kl_ctrl = build_kl_controller(k.controller, k.coef, k.target, k.horizon)
        self.metrics: dict = {}
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

    @property
    def on_policy(self) -> bool:
        # a rollout a step ahead samples from older weights: the actor always recomputes old log-probs
        a = self.cfg.actor
        return a.ppo_epochs == 1 and self.num_mini_batches == 1 and not self.cfg.trainer.rollout_ahead

    # ---- phases ---------------------------------------------------------------------------------------
    def generate(self, prompts: Batch) -> Batch:
        if self.ahead.serves(self.global_step):
            batch = self.ahead.generate(prompts)
        else:
            batch = self.actor.generate_sequences(prompts)
        self.metrics.update(batch.meta.pop("reshard_metrics", {}))  # reshard/*, timing_s/reshard
        batch.meta.update(prompts.meta)
        return batch

    def old_log_probs(self, batch: Batch) -> Batch:
        # The rollout's own log-probs stand in only in fp32 (under bf16 the decoder's rounding differs
        # from the training forward's) and when the engine says they follow the training convention
        # (vLLM's under top-k/top-p truncation do not: rollout/vllm_engine.py); else the actor recomputes.
        exact = computes_in_fp32(self.cfg.model.dtype, self.cfg.resources.device)
        if self.on_policy and exact and batch.meta.get("rollout_log_probs_exact", True):
            batch["old_log_probs"] = batch["rollout_log_probs"]
            return batch
        return batch.union(self.actor.compute_log_prob(batch))

    def ref_log_probs(self, batch: Batch) -> Batch:
        return batch.union(self.ref.compute_ref_log_prob(batch)) if self.uses_ref else batch

    def values(self, batch: Batch) -> Batch:
        return batch.union(self.critic.compute_values(batch))

    def reward(self, batch: Batch) -> Batch:
        batch["scores"], metrics = self.score(batch)
        self.metrics.update(metrics)
        batch["token_level_scores"] = token_level(batch["scores"], batch["response_mask"])
        k = self.cfg.algorithm.kl
        if not k.in_reward:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return batch
        rewards, kl = apply_kl_penalty(
            batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"],
            batch["response_mask"], self.kl_ctrl.value, k.kind,
        )  # fmt: skip
        self.metrics.update(
            {"actor/reward_kl_penalty": float(kl), "actor/reward_kl_penalty_coeff": self.kl_ctrl.value}
        )
        self.kl_ctrl.update(float(kl), len(batch))
        batch["token_level_rewards"] = rewards
        return batch

    def compute_advantages(self, batch: Batch) -> Batch:
        raise NotImplementedError

    def update_critic(self, batch: Batch) -> None:
        self.metrics.update(self.critic.update_critic(batch))

    def update_actor(self, batch: Batch) -> None:
        self.metrics.update(self.actor.update_actor(batch))

    def finish(self, batch: Batch) -> tuple[Batch, dict]:
        """Collect this step's metrics (the phases' plus those of the batch)."""
        metrics, self.metrics = self.metrics, {}
        metrics.update(data_metrics(batch))
        return batch, metrics

    def next_prompts(self) -> Batch:
        ahead = self.ahead.next_prompts(self.global_step)
        return ahead if ahead is not None else super().next_prompts()

    # ---- state ------------------------------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"kl_ctrl": self.kl_ctrl.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        self.ahead.reset()  # a restart or a resume: what was in flight is gone (load_checkpoint restores it)
        if "kl_ctrl" in state:
            self.kl_ctrl.load_state_dict(state["kl_ctrl"])

    def save_driver_parts(self, directory) -> None:
        self.ahead.save(directory)

    def load_checkpoint(self, path) -> None:
        super().load_checkpoint(path)
        self.ahead.load(path)
