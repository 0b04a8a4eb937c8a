"""The role workers on real worker groups (2 ranks, gloo): generation on FSDP-unsharded or gathered
weights agrees with the training forward, updates move the policy and the critic, checkpoints restore."""

from __future__ import annotations

import pytest
import torch

from hybridflow.config.roles import worker_config
from hybridflow.controller import ResourcePool, create_colocated_groups
from hybridflow.data import build_prompt_dataset
from hybridflow.models import load_tokenizer
from hybridflow.trainers.placement import shutdown
from hybridflow.workers import ActorRolloutRefWorker, CriticWorker
from tests.trainers.configs import tiny_config


def _groups(cfg, name, roles):
    pool = ResourcePool(2, name=name)
    groups = create_colocated_groups(pool, roles, group_name=name)
    for g in groups.values():
        g.init_model()
    return groups, pool


@pytest.fixture(scope="module")
def setup(ray_cluster, tiny_model_dir, tmp_path_factory):
    """On 2 ranks: actor + rollout + ref (dp=2, FSDP2) colocated with a critic, and a second actor
    with tp=2 in the same processes (starting processes is the slow part on 2 cores)."""
    runs = tmp_path_factory.mktemp("runs")
    cfg = tiny_config(tiny_model_dir, runs, "ppo", "algorithm.kl.in_reward=true",
                      "actor.optim.lr=1e-2", "critic.optim.lr=1e-2", devices=2)  # fmt: skip
    tp2 = tiny_config(tiny_model_dir, runs, "grpo", "actor.parallel.tp=2", "ref.parallel.tp=2", devices=2)
    roles = {
        "actor": (
            ActorRolloutRefWorker,
            {"config": worker_config(cfg, "actor_rollout"), "roles": ("actor", "rollout", "ref")},
        ),
        "critic": (CriticWorker, {"config": worker_config(cfg, "critic")}),
        "actor_tp2": (ActorRolloutRefWorker, {"config": worker_config(tp2, "actor_rollout")}),
    }
    groups, pool = _groups(cfg, "workers_dp2", roles)
    ds = build_prompt_dataset(cfg.data, load_tokenizer(tiny_model_dir), "val")
    prompts = ds.collate([ds[i] for i in range(5)])  # 5 prompts: not a multiple of dp=2
    yield cfg, groups, prompts
    shutdown(groups, [pool])


def _masked(x, batch):
    return x[batch["response_mask"].bool()]


def test_rollout_log_probs_match_training_forward(setup):
    _, g, prompts = setup
    batch = g["actor"].generate_sequences(prompts)
    assert len(batch) == 5 * 2 and batch["responses"].shape[1] == 4
    old = g["actor"].compute_log_prob(batch)["old_log_probs"]
    ref = g["actor"].compute_ref_log_prob(batch)["ref_log_probs"]
    # generation read the full (unsharded) weights: its log-probs are the training forward's
    torch.testing.assert_close(
        _masked(batch["rollout_log_probs"], batch), _masked(old, batch), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(_masked(ref, batch), _masked(old, batch), atol=1e-6, rtol=0)
    first = batch["responses"][0][: int(batch["response_mask"][0].sum())]
    assert (
        batch["response_text"][0]
        == g["actor"].execute_rank_zero("decode", first[None], torch.tensor([len(first)]))[0]
    )
    greedy = g["actor"].generate_sequences(prompts, sampling={"n": 1, "temperature": 0.0})
    again = g["actor"].generate_sequences(prompts, sampling={"n": 1, "temperature": 0.0})
    assert len(greedy) == 5 and torch.equal(greedy["responses"], again["responses"])


def test_update_actor_and_checkpoint_roundtrip(setup, tmp_path):
    _, g, prompts = setup
    batch = g["actor"].generate_sequences(prompts)
    batch["old_log_probs"] = batch["rollout_log_probs"]
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    g["actor"].save_checkpoint(str(tmp_path))
    metrics = g["actor"].update_actor(batch)
    # on-policy first step: ratio 1, nothing clipped, approx KL 0
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/grad_norm"] > 0
    moved = g["actor"].compute_log_prob(batch)["old_log_probs"]
    assert (_masked(moved - batch["rollout_log_probs"], batch)).abs().max() > 1e-3
    # positive advantages gained probability, negative ones lost it (per sequence)
    gain = ((moved - batch["rollout_log_probs"]) * batch["response_mask"]).sum(-1)
    assert gain[-1] > 0 > gain[0]
    g["actor"].load_checkpoint(str(tmp_path))
    back = g["actor"].compute_log_prob(batch)["old_log_probs"]
    torch.testing.assert_close(
        _masked(back, batch), _masked(batch["rollout_log_probs"], batch), atol=1e-5, rtol=0
    )


def test_critic_regresses_on_returns(setup):
    _, g, prompts = setup
    batch = g["actor"].generate_sequences(prompts)
    batch = batch.union(g["critic"].compute_values(batch))
    assert float(batch["values"].abs().max()) == 0.0  # zero-initialised value head
    batch["returns"] = 0.5 * batch["response_mask"].float()
    losses = []
    for _ in range(4):
        losses.append(g["critic"].update_critic(batch)["critic/vf_loss"])
        batch.tensors["values"] = g["critic"].compute_values(batch)["values"]
    assert losses[-1] < 0.5 * losses[0]


def test_tp2_generation_gathers_full_weights(setup):
    """Actor with tp=2: generation runs on a gathered full copy; log-probs still match training."""
    _, g, prompts = setup
    batch = g["actor_tp2"].generate_sequences(prompts.index(slice(0, 3)))
    old = g["actor_tp2"].compute_log_prob(batch)["old_log_probs"]
    torch.testing.assert_close(
        _masked(batch["rollout_log_probs"], batch), _masked(old, batch), atol=1e-5, rtol=0
    )
