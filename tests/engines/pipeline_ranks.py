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

BATCH = dict(batch_size=8, lp=6, lr=8, seed=4)  # every case's batch
SGD_LR = 10.0  # the clipped gradients are ~1e-3: weights move by ~1e-2
GROUP = 4  # GRPO's samples per prompt
NOISE = 0.1  # old log-probs / values = the forward's + NOISE * N(0, 1): ratios off 1, some clipped


def loss_inputs(kind: str, outputs: torch.Tensor, batch, rows: slice = slice(None)) -> torch.Tensor:
    """(B, 3, Lr) per-token tensors the last stage's loss reads: old outputs, advantages (the critic's
    returns; GRPO's from seeded scores in groups of GROUP), response mask, for `rows` of the whole batch
    (BATCH) that `batch` holds; the old outputs from `outputs` (the forward-only pass) and a seeded noise."""
    from hybridflow.algorithms.advantages import compute_grpo_advantages

    g = torch.Generator().manual_seed(7)
    noise = torch.randn(BATCH["batch_size"], outputs.shape[1], generator=g)
    old = outputs.detach() + NOISE * noise[rows]
    adv = batch["advantages"]
    if kind == "grpo":
        scores, groups = (
            torch.randn(BATCH["batch_size"], generator=g),
            torch.arange(BATCH["batch_size"]) // GROUP,
        )
        whole = make_rl_batch(64, **BATCH)["response_mask"]  # the mask depends on the seed only
        adv = compute_grpo_advantages(scores, groups, whole)[0][rows]
    return torch.stack([old, adv, batch["response_mask"].float()], 1)


def normaliser(kind: str, whole, dp: int) -> float:
    """What each rank's summed loss is divided by: the whole batch's tokens (GRPO: sequences, its
    seq-mean-token-mean), over dp, as FSDP2 averages gradients over dp."""
    mask = whole["response_mask"]
    return float((mask.sum(-1) > 0).sum() if kind == "grpo" else mask.sum()) / dp


def rl_loss(kind: str, norm: float):
    """loss_fn(outputs (B, Lr), target (B, 3, Lr)): the actor's clipped policy loss (dual clip) or the
    critic's clipped value loss, token-summed, over `norm`; GRPO's per-sequence token means, summed over
    `norm` (each micro-batch's seq-mean-token-mean times its sequences)."""

    def loss_fn(outputs, target):
        old, adv, mask = target.unbind(1)
        if kind == "critic":
            return value_loss(outputs, old, adv, mask, clip_range=0.05, agg="token-sum")[0] / norm
        if kind == "grpo":
            seqs = (mask.sum(-1) > 0).sum()
            return policy_loss(outputs, old, adv, mask, agg="seq-mean-token-mean")[0] * seqs / norm
        return policy_loss(outputs, old, adv, mask, clip_ratio_c=3.0, agg="token-sum")[0] / norm

    return loss_fn


def run_pipeline_case(case: dict, out_dir) -> dict:
    """On a (pp, dp, tp) mesh (case dp, tp; pp the rest of the ranks): forward-only outputs, the loss,
    every gradient by its HF name and the global grad norm after clipping (to 1e-3: it clips)."""
    from torch.distributed.tensor import DTensor

    from hybridflow.engines.optim import clip_grad_norm_
    from hybridflow.engines.pipeline import (
        build_pipeline_mesh,
        build_pipeline_stages,
        build_schedule,
        build_stages,
        hf_name,
        parallelize_stages,
        stage_state_dict,
    )
    from hybridflow.models import load_causal_lm, load_critic

    dp, tp, v = case.get("dp", 1), case.get("tp", 1), case.get("stages_per_rank", 1)
    pp = dist.get_world_size() // (dp * tp)
    mesh = build_pipeline_mesh(pp, dp, tp)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = (load_critic if case["kind"] == "critic" else load_causal_lm)(case["model_dir"])
    whole = make_rl_batch(model.config.vocab_size, **BATCH)
    batch = whole.chunk(dp)[dp_rank]
    shard = whole["input_ids"].shape[0] // dp
    mine = slice(dp_rank * shard, (dp_rank + 1) * shard)
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    rows, m = ids.shape[0], case["microbatches"]
    stage = build_stages(model, pp_rank, pp, v)
    stage.configure(batch["responses"].shape[1], logits_chunk_size=4)
    parallelize_stages(stage, mesh)
    group = mesh["pp"].get_group()
    pipe = build_pipeline_stages(stage, pp * v, rows // m, ids.shape[1], "cpu", group=group)
    inputs = (ids, mask, pos) if pp_rank == 0 else ()
    with torch.no_grad():  # forward-only: a schedule without a loss over the same stages
        outputs = build_schedule(case["schedule"], pipe, m).eval(*inputs)
    schedule = build_schedule(
        case["schedule"], pipe, m, rl_loss(case["kind"], normaliser(case["kind"], whole, dp))
    )
    target = loss_inputs(case["kind"], outputs, batch, mine) if outputs is not None else None
    losses: list[torch.Tensor] = []
    schedule.step(*inputs, target=target, losses=losses)
    params = list(stage.parameters())
    norm = clip_grad_norm_(params, 1e-3, pp_group=group)
    grads = {
        hf_name(stage.model, n): p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in stage.model.named_parameters()
    }
    with torch.no_grad():  # one SGD step, so the exported weights differ from the loaded ones
        for p in params:
            p.sub_(SGD_LR * p.grad)
    state = stage_state_dict(stage.model)
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (outputs, sum(float(x.detach()) for x in losses), grads, state))
    last = [s for s in shards[::tp] if s[0] is not None]  # one tp rank of each dp rank of the last stage
    return {
        "outputs": torch.cat([s[0] for s in last]),
        "loss": sum(s[1] for s in last) / dp,
        "grads": {k: g for s in shards for k, g in s[2].items()},
        "state": {k: w for s in shards for k, w in s[3].items()},
        "norm": float(norm),
    }


def run_mesh_case(case: dict, out_dir) -> dict:
    """run_engine_case for the cases naming an engine role, run_pipeline_case for the others: both
    kinds share one four-rank group."""
    return (run_engine_case if "role" in case else run_pipeline_case)(case, out_dir)


def run_engine_case(case: dict, out_dir) -> dict:
    """TrainEngine on (pp, dp) = case["pp"], world / pp, the model read as shards (meta): log-probs and
    entropy of the whole batch, then two train steps of the actor's loss under seq-mean-token-mean
    (GRPO's), micro-batches of 2 rows; the loss and grad norm of each step, every rank's."""
    from rl_data import actor_agg_loss

    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_causal_lm

    if "role" in case:
        return _forward_only_case(case)
    if "resumed" in case:
        return _critic_resume_case(case, out_dir)
    pp = case["pp"]
    dp = dist.get_world_size() // pp
    config = EngineConfig(
        parallel=ParallelConfig(pp=pp, dp=dp),
        optim=OptimConfig(lr=1e-2, grad_clip=1.0, eps=1e-6),
        logits_chunk_size=4,
        micro_batch_size_per_device=2,
    )
    engine = TrainEngine(load_causal_lm(case["model_dir"], device="meta"), config)
    whole = make_rl_batch(engine.hf_model.config.vocab_size, **BATCH)
    local = whole.chunk(dp)[(dist.get_rank()) % dp]
    log_probs, entropy = engine.compute_log_probs(local, with_entropy=True)
    loss_fn, weighting = actor_agg_loss("seq-mean-token-mean")
    steps = [
        engine.train_step(
            local, loss_fn, with_entropy="detached", loss_weighting=weighting, global_metrics=True
        )
        for _ in range(2)
    ]
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (log_probs, entropy, steps))
    return {"shards": shards}


def _forward_only_case(case: dict) -> dict:
    """A reference (frozen causal LM), a critic or a reward model on (pp, tp) = case["pp"], case["tp"]
    (1 unless given), dp the rest of the world, read as shards: its forward-only outputs of the whole
    batch (log-probs, values or scores), every rank's; case["train"]: then a critic's step of its clipped
    value loss (CRITIC_TARGETS) and its metrics, every rank's."""
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_causal_lm, load_critic, load_reward_model

    role, pp, tp = case["role"], case["pp"], case.get("tp", 1)
    dp = dist.get_world_size() // (pp * tp)
    load = {"ref": load_causal_lm, "critic": load_critic, "reward": load_reward_model}[role]
    config = EngineConfig(
        parallel=ParallelConfig(pp=pp, dp=dp, tp=tp),
        optim=OptimConfig(lr=1e-2, eps=1e-6),
        logits_chunk_size=4,
        micro_batch_size_per_device=2,
    )
    engine = TrainEngine(load(case["model_dir"], device="meta"), config, trainable=role == "critic")
    whole = critic_targets(make_rl_batch(engine.hf_model.config.vocab_size, **BATCH))
    local = whole.chunk(dp)[engine.mesh["dp"].get_local_rank()]
    if role == "ref":
        out = engine.compute_log_probs(local)[0]
    else:
        out = engine.compute_values(local) if role == "critic" else engine.compute_scores(local)
    if case.get("train"):
        out = (out, engine.train_step(local, _critic_loss(), global_metrics=True))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, out)
    return {"shards": shards}


def critic_targets(whole):
    """`whole` with seeded old values (~0.1) and returns (~1), the critic's loss inputs."""
    gen = torch.Generator().manual_seed(5)
    whole["values"] = 0.1 * torch.randn(whole["response_mask"].shape, generator=gen)
    whole["returns"] = torch.randn(whole["response_mask"].shape, generator=gen)
    return whole


def _critic_loss():
    from hybridflow.config.schema import CriticConfig
    from hybridflow.workers.losses import critic_loss_fn

    return critic_loss_fn(CriticConfig(), "values", "returns", BATCH["lr"])


def _critic_engine(model_dir: str, pp: int):
    from hybridflow.engines import EngineConfig, OptimConfig, ParallelConfig, TrainEngine
    from hybridflow.models import load_critic

    parallel = ParallelConfig(pp=pp, dp=dist.get_world_size() // pp)
    optim = OptimConfig(lr=1e-2, eps=1e-6)
    config = EngineConfig(parallel=parallel, optim=optim, logits_chunk_size=4, micro_batch_size_per_device=2)
    return TrainEngine(load_critic(model_dir, device="meta"), config)


def _critic_resume_case(case: dict, out_dir) -> dict:
    """The critic trained one step of its clipped value loss at pp = case["saved"], checkpointed, resumed
    on a new engine at pp = case["resumed"] and trained one more step: that step's metrics and the values
    after it, every rank's."""
    whole = critic_targets(make_rl_batch(64, **BATCH))
    loss_fn = _critic_loss()
    path = out_dir / f"{case['name']}_checkpoint"
    steps = []
    for pp in (case["saved"], case["resumed"]):
        engine = _critic_engine(case["model_dir"], pp)
        dp = engine.dp_size
        local = whole.chunk(dp)[dist.get_rank() % dp]
        if pp == case["resumed"]:
            engine.load_checkpoint(path)
        steps.append(engine.train_step(local, loss_fn, global_metrics=True))
        if pp == case["saved"]:
            engine.save_checkpoint(path)
            dist.barrier()
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (steps[-1], engine.compute_values(local)))
    return {"shards": shards}
