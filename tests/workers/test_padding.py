"""A batch that does not divide dp trains exactly as on one rank, and the reference reads the rollout's
temperature. Real worker groups (gloo): the same tiny model on 1 rank (dp=1) and on 2 ranks (dp=2,
FSDP2), so 3 rollouts reach the 2 ranks as [r0, r1] and [r2, r0-copy]: the copy must weigh nothing."""

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


@pytest.fixture(scope="module")
def setup(ray_cluster, tiny_model_dir, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    groups, pools = {}, []
    for n in (1, 2):
        cfg = tiny_config(
            tiny_model_dir, runs, "ppo", "rollout.n=1", "rollout.temperature=0.7", "actor.optim.lr=1e-2",
            "critic.optim.lr=1e-2", "critic.loss_agg_mode=seq-mean-token-mean",
            "actor.micro_batch_size_per_device=1", devices=n,
        )  # fmt: skip
        roles = {
            "actor": (
                ActorRolloutRefWorker,
                {"config": worker_config(cfg, "actor_rollout"), "roles": ("actor", "rollout", "ref")},
            ),
            "critic": (CriticWorker, {"config": worker_config(cfg, "critic")}),
        }
        pools.append(ResourcePool(n, name=f"padding_dp{n}"))
        groups[n] = create_colocated_groups(pools[-1], roles, group_name=f"padding_dp{n}")
        for g in groups[n].values():
            g.init_model()
    ds = build_prompt_dataset(cfg.data, load_tokenizer(tiny_model_dir), "val")
    batch = groups[1]["actor"].generate_sequences(ds.collate([ds[i] for i in range(3)]))
    yield groups, batch
    shutdown({f"{n}/{r}": g for n, gs in groups.items() for r, g in gs.items()}, pools)


def _masked(x, batch):
    return x[batch["response_mask"].bool()]


def test_reference_log_probs_at_the_rollout_temperature(setup):
    """At step 0 the reference is the actor: at the same temperature their log-probs are equal (a
    reference at temperature 1 would put a spurious KL into the reward or the KL loss)."""
    groups, batch = setup
    assert batch.meta.temperature == pytest.approx(0.7)
    old = groups[1]["actor"].compute_log_prob(batch)["old_log_probs"]
    for n in (1, 2):
        ref = groups[n]["actor"].compute_ref_log_prob(batch)["ref_log_probs"]
        torch.testing.assert_close(_masked(ref, batch), _masked(old, batch), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        _masked(old, batch), _masked(batch["rollout_log_probs"], batch), atol=1e-5, rtol=0
    )


def test_padding_rows_do_not_train(setup):
    """update_actor / update_critic on 3 rows: dp=2 (one padding copy) gives the losses, metrics,
    gradient norm and updated policy of dp=1 (no padding)."""
    groups, batch = setup
    assert len(batch) == 3
    mask = batch["response_mask"].float()
    batch["old_log_probs"] = batch["rollout_log_probs"]
    batch["advantages"] = torch.tensor([[-1.0], [0.3], [1.0]]) * mask  # the padded row 0 pulls one way
    batch["values"] = torch.zeros_like(mask)
    batch["returns"] = torch.tensor([[2.0], [0.5], [-1.0]]) * mask
    one, two = (groups[n]["actor"].update_actor(batch) for n in (1, 2))
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    assert two["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"], rel=1e-4)
    moved = [groups[n]["actor"].compute_log_prob(batch)["old_log_probs"] for n in (1, 2)]
    assert (_masked(moved[0] - batch["rollout_log_probs"], batch)).abs().max() > 1e-3  # the update moved it
    torch.testing.assert_close(_masked(moved[1], batch), _masked(moved[0], batch), atol=1e-4, rtol=0)
    one, two = (groups[n]["critic"].update_critic(batch) for n in (1, 2))  # seq-mean: counts sequences
    for key in ("critic/vf_loss", "critic/vpred_mean", "critic/grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
