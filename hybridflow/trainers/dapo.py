"""DAPO (Yu et al. 2025, verl's recipe/dapo): GRPO advantages, plus what makes each step's batch worth
training on. As verl runs it: adv_estimator grpo, with

  dynamic sampling  (algorithm.filter_groups) groups whose samples all score the same carry no GRPO
                    signal: they are dropped and more prompts are drawn from the loader and generated
                    until data.train_batch_size groups are kept (the surplus of the last generation
                    batch is trimmed); after max_num_gen_batches the run stops in one line, as verl's
                    does, naming the step (training on a short batch would break the mini-batch
                    tiling, and an empty one trains on nothing)
  overlong shaping  (reward.overlong_buffer) responses in the last `len` tokens before the cap lose up
                    to `penalty_factor` of their score, before the groups are judged (verl's
                    seq_final_reward includes it)
  overlong filter   (actor.mask_truncated) responses that reached the cap take no part in the loss:
                    their response_mask is zeroed after the advantages and batch metrics (so
                    response_length/clip_ratio still counts them)

Clip-higher (actor.clip_ratio_high 0.28) and token-mean aggregation are the actor's own settings, set
by examples/configs/dapo_tiny.yaml. Scoring moves into the generation phase (timing_s/gen includes
it; the reward phase has nothing left to do), since the groups to keep are known only from scores.
The extra prompts move the loader on, and checkpoints save its position: a resumed run repeats the
uninterrupted one. Generation batch k > 0 of a step samples with its own seed key, so refills never
repeat the first batch's random draws.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridflow.algorithms.dynamic_sampling import (
    GroupAccumulator,
    keep_groups,
    overlong_penalty,
    truncated_rows,
)
from hybridflow.batch import Batch
from hybridflow.config.algorithms import ALGORITHM_SPECS
from hybridflow.errors import RunStopped
from hybridflow.rollout.base import response_lengths
from hybridflow.trainers.experience import Pending, make_experience
from hybridflow.trainers.grpo import GRPOTrainer

# meta.global_step of generation batch k > 0: the actor's sampling-seed key, apart from every step's
# own (k = 0) and from validation's (1_000_000 + calls)
_REFILL_KEY = 1_000_000_000
# fields whose columns start with the prompt's (left-padded) ones: padded further left to concatenate
_PROMPT_LEFT = {"prompts": "pad", "input_ids": "pad", "attention_mask": 0, "position_ids": 0}


class DAPOTrainer(GRPOTrainer):
    name = "dapo"
    spec = ALGORITHM_SPECS["dapo"]

    def generate(self, prompts: Batch) -> Pending:
        """Generate, score and keep varied groups until the batch is full (filter_groups), or once. Each
        generation batch comes from the rollout source (synchronous: trainer.rollout_ahead is refused)."""
        fg, n = self.cfg.algorithm.filter_groups, self.cfg.rollout.n
        acc = GroupAccumulator(len(prompts), n, concat=self._concat)
        all_scores, batch, first = [], prompts, None
        while True:
            if acc.num_gen_batches:
                batch = self.train_loader.next_batch()
                batch.meta.global_step = _REFILL_KEY * acc.num_gen_batches + self.global_step
            pending = super().generate(batch)
            first, rollout = first or pending, pending.local
            rollout.meta.global_step = self.global_step  # a refill's rows belong to this step
            rollout["scores"] = self._shaped_scores(rollout)
            all_scores.append(rollout["scores"])
            keep = keep_groups(self._filter_metric(rollout), rollout["uid"]) if fg.enable else None
            acc.add(rollout, torch.ones(len(rollout), dtype=torch.bool) if keep is None else keep)
            if acc.full:
                break
            if fg.max_num_gen_batches and acc.num_gen_batches >= fg.max_num_gen_batches:
                raise RunStopped(
                    f"dynamic sampling kept {acc.kept_groups} of the {len(prompts)} groups needed in "
                    f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} generation batches "
                    f"({acc.dropped_groups} groups scored all alike): the data is too easy or too hard for "
                    "the policy; raise max_num_gen_batches (0 = unlimited) or change the data"
                )
        out = acc.take()
        self.metrics.update(self._sampling_metrics(acc, out, torch.cat(all_scores)))
        # the kept rows; where old log-probs come from and the lag are the source's answer for every batch
        return Pending(dataclasses.replace(first.step, rollout=out, scored={}, generated=None))

    def chained_on_rollout(self) -> list[str]:
        """None: a generation batch's groups are filtered by their scores before anything else scores them."""
        return []

    def reward(self, batch: Pending) -> Pending:
        """Scored (and shaped) in `generate`: the groups to keep are chosen by their scores."""
        return batch

    def compute_advantages(self, batch: Pending) -> Pending:
        """GRPO's experience on the actor's rank 0, then truncated responses masked (actor.mask_truncated)."""
        cap = self.cfg.rollout.response_length if self.cfg.actor.mask_truncated else 0
        fn, kl = type(self).advantage_fn, self.kl_ctrl.value
        batch.experience = self.actor.apply.future(
            make_dapo_experience,
            cap,
            fn,
            self.cfg.algorithm,
            kl,
            self.advantage_state(),
            *batch.rollout_parts(),
            *batch.parts,
        )
        return batch

    # ---- pieces -------------------------------------------------------------------------------------
    def _shaped_scores(self, rollout: Batch) -> torch.Tensor:
        """(B,) float32 sequence scores of the run's reward, plus the overlong penalty when enabled."""
        scores, metrics = self.score(rollout)
        self.metrics.update(metrics)  # the rule executor's counts: the step's last generation batch
        ob = self.cfg.reward.overlong_buffer
        if not ob.enable:
            return scores.float()
        lengths = response_lengths(rollout)
        penalty = overlong_penalty(lengths, self.cfg.rollout.response_length, ob.len, ob.penalty_factor)
        return (scores.double() + penalty).float()

    def _filter_metric(self, rollout: Batch) -> torch.Tensor:
        """(B,) the value that must vary within a kept group: the shaped score, or the rule's `acc`."""
        if self.cfg.algorithm.filter_groups.metric == "score":
            return rollout["scores"]
        extras = self.rule_reward.last_extras
        missing = next((i for i, e in enumerate(extras) if "acc" not in e), None)
        if missing is not None or len(extras) != len(rollout):
            raise RunStopped(
                f"algorithm.filter_groups.metric=acc: the reward function returned no 'acc' key (sample "
                f"{missing}); return a dict with 'score' and 'acc', or set metric=score"
            )
        return torch.tensor([float(e["acc"]) for e in extras], dtype=torch.float64)

    def _concat(self, parts: list[Batch]) -> Batch:
        """Rollouts of several generation batches as one: prompt columns left-padded to the widest."""
        width = max(p["prompts"].shape[1] for p in parts)
        pad_id = getattr(self.train_loader.dataset, "pad_token_id", 0)
        return Batch.concat([left_pad_prompts(p, width, pad_id) for p in parts])

    def _sampling_metrics(self, acc: GroupAccumulator, out: Batch, all_scores: torch.Tensor) -> dict:
        metrics = {
            "dapo/num_gen_batches": float(acc.num_gen_batches),
            "dapo/groups_kept": float(acc.kept_groups),
            "dapo/groups_dropped": float(acc.dropped_groups),
            "dapo/gen_score_mean": float(all_scores.double().mean()),
        }
        ob = self.cfg.reward.overlong_buffer
        if ob.enable:
            lengths = response_lengths(out)
            penalty = overlong_penalty(lengths, self.cfg.rollout.response_length, ob.len, ob.penalty_factor)
            metrics["dapo/overlong_penalty_mean"] = float(penalty.mean())
        return metrics


def left_pad_prompts(batch: Batch, width: int, pad_id: int) -> Batch:
    """The rollout with its prompt columns left-padded to `width` (pad id / mask 0 / position 0): the same
    rows, attended tokens and positions, so the same log-probs."""
    extra = width - batch["prompts"].shape[1]
    if extra == 0:
        return batch
    out = Batch(dict(batch.tensors), dict(batch.non_tensors), batch.meta.copy())
    for key, fill in _PROMPT_LEFT.items():
        t = batch[key]
        pad = torch.full(
            (t.shape[0], extra), pad_id if fill == "pad" else fill, dtype=t.dtype, device=t.device
        )
        out[key] = torch.cat([pad, t], dim=1)
    return out


def make_dapo_experience(cap: int, advantage_fn, algo, kl_coef: float, state: dict, *parts: Batch) -> Batch:
    """experience.make_experience, then (cap > 0) the rows whose response reached `cap` tokens masked
    out of the loss: their response_mask zeroed (as padding rows', workers/common.py), so they weigh
    nothing in any aggregation mode. Runs on the actor's rank 0; dapo/masked_truncated is their share."""
    batch = make_experience(advantage_fn, algo, kl_coef, state, *parts)
    if cap:
        rows = truncated_rows(
            batch["attention_mask"][:, -batch["responses"].shape[1] :], cap
        )  # tool tokens too
        batch["response_mask"] = batch["response_mask"] * (~rows).to(batch["response_mask"].dtype)[:, None]
        batch.meta.call_info["dapo/masked_truncated"] = float(rows.float().mean())
    return batch
