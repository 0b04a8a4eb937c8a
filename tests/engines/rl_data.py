"""Synthetic RL batches (left-padded prompts, right-padded responses) and losses shared by engine tests."""

from __future__ import annotations

import torch

from hybridflow.batch import Batch, position_ids_from_mask
from hybridflow.models.tiny import random_rl_batch


def make_rl_batch(
    vocab_size: int, batch_size: int = 8, lp: int = 6, lr: int = 8, seed: int = 0, group: int = 1
) -> Batch:
    """Random tokens with random valid prompt lengths (1..lp) and response lengths (1..lr); group > 1:
    each run of `group` consecutive rows has the prompt of its first row (GRPO's n samples)."""
    batch = random_rl_batch(vocab_size, batch_size, lp, lr, seed)
    if group > 1:
        first = torch.arange(batch_size) // group * group
        prompts = batch["prompts"][first]
        attn = torch.cat([(prompts != 0).long(), batch["response_mask"]], 1)
        batch["prompts"] = prompts
        batch["input_ids"] = torch.cat([prompts, batch["responses"]], 1)
        batch["attention_mask"] = attn
        batch["position_ids"] = position_ids_from_mask(attn)
    return batch


def pg_loss(outputs, mb):
    """A token-mean policy-gradient-like loss (exercises log-probs, advantages and masking)."""
    mask = mb["response_mask"].float()
    loss = -(outputs["log_probs"] * mb["advantages"] * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"neg_lp": float(-(outputs["log_probs"].detach() * mask).sum() / mask.sum().clamp(min=1))}


def actor_agg_loss(mode: str, norm_length: int = 8):
    """The actor's policy loss (vanilla, its own forward as the old log-probs) under loss_agg_mode `mode`,
    and the engine weighting that mode takes: (loss_fn, loss_weighting), as workers/actor.py builds them."""
    from hybridflow.config.schema import ActorConfig, AlgorithmConfig
    from hybridflow.workers.losses import actor_loss_fn, split_aggregation

    actor = ActorConfig(loss_agg_mode=mode)
    return actor_loss_fn(actor, AlgorithmConfig(), norm_length, old_from_forward=True), split_aggregation(
        mode
    )[1]


def reference_log_probs(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain HF forward (full logits): log-probs and entropy of the responses, (B, Lr)."""
    lr = batch["responses"].shape[1]
    with torch.no_grad():
        logits = (
            model(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            )
            .logits[:, -lr - 1 : -1]
            .float()
        )
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent
