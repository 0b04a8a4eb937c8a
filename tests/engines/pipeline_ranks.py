"""Rank entry point of the pipeline tests (dist_workers.run_group's runner): one model cut into stages
over the group's ranks, a forward-only pass and one RL loss step under a pipelining schedule.

The RL losses (algorithms/losses.py) run on the last stage, summed over tokens and divided by the whole
batch's token count, so the micro-batches' gradients add up to the token-mean's (scale_grads=False).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rl_data import make_rl_batch

from hybridflow.algorithms.losses import policy_loss, value_loss

NOISE = 0.1  # old log-probs / values = the forward's + NOISE * N(0, 1): ratios off 1, some clipped


def loss_inputs(outputs: torch.Tensor, batch) -> torch.Tensor:
    """(B, 3, Lr) per-token tensors the last stage's loss reads: old outputs, advantages (the critic's
    returns), response mask; the old outputs from `outputs` (the forward-only pass) and a seeded noise."""
    noise = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(7))
    old = outputs.detach() + NOISE * noise
    return torch.stack([old, batch["advantages"], batch["response_mask"].float()], 1)


def rl_loss(kind: str, n_tokens: float):
    """loss_fn(outputs (B, Lr), target (B, 3, Lr)): the actor's clipped policy loss (dual clip) or the
    critic's clipped value loss, token-summed over / n_tokens."""

    def loss_fn(outputs, target):
        old, adv, mask = target.unbind(1)
        if kind == "critic":
            return value_loss(outputs, old, adv, mask, clip_range=0.05, agg="token-sum")[0] / n_tokens
        return policy_loss(outputs, old, adv, mask, clip_ratio_c=3.0, agg="token-sum")[0] / n_tokens

    return loss_fn


def run_pipeline_case(case: dict, out_dir) -> dict:
    """Forward-only outputs, the loss, every gradient by its HF name and the clipped global grad norm."""
    from hybridflow.engines.optim import clip_grad_norm_
    from hybridflow.engines.pipeline import build_pipeline_stages, build_schedule, build_stages, hf_name
    from hybridflow.models import load_causal_lm, load_critic

    rank, pp, v = dist.get_rank(), dist.get_world_size(), case.get("stages_per_rank", 1)
    model = (load_critic if case["kind"] == "critic" else load_causal_lm)(case["model_dir"])
    batch = make_rl_batch(model.config.vocab_size, **case["batch"])
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    rows, m = ids.shape[0], case["microbatches"]
    stages = build_stages(model, rank, pp, v)
    for _, stage in stages:
        stage.configure(batch["responses"].shape[1], logits_chunk_size=4)
    n_tokens = float(batch["response_mask"].sum())
    pipe = build_pipeline_stages(stages, pp * v, rows // m, ids.shape[1], "cpu")
    inputs = (ids, mask, pos) if rank == 0 else ()
    with torch.no_grad():  # forward-only: a schedule without a loss over the same stages
        outputs = build_schedule(case["schedule"], pipe, m).eval(*inputs)
    schedule = build_schedule(case["schedule"], pipe, m, rl_loss(case["kind"], n_tokens))
    target = loss_inputs(outputs, batch) if outputs is not None else None
    losses: list[torch.Tensor] = []
    schedule.step(*inputs, target=target, losses=losses)
    params = [p for _, s in stages for p in s.parameters()]
    norm = clip_grad_norm_(params, 1e-3, pp_group=dist.group.WORLD)  # clips: the norm is ~1
    grads = {hf_name(s.model, n): p.grad for _, s in stages for n, p in s.model.named_parameters()}
    shards = [None] * pp
    dist.all_gather_object(shards, (outputs, sum(float(x) for x in losses), grads))
    last = next(s for s in shards if s[0] is not None)
    return {
        "outputs": last[0],
        "loss": last[1],
        "grads": {k: g for s in shards for k, g in s[2].items()},
        "norm": float(norm),
    }
