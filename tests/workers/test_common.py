"""Pure pieces of the workers, without Ray: config -> engine config, the mini-batch loop, loss adapters."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta
from hybridflow.config import ParallelConfig, load_config
from hybridflow.workers.common import engine_config, engine_parallel, iter_mini_batches, mask_padding
from hybridflow.workers.losses import actor_loss_fn, dpo_loss_fn


def test_engine_parallel_checks_the_resolved_dp_against_the_group():
    assert engine_parallel(ParallelConfig(tp=2, dp=4), 8, "actor").world_size == 8
    with pytest.raises(ValueError, match="dp must be 4"):
        engine_parallel(ParallelConfig(tp=2), 8, "actor")  # dp=0: not resolved
    with pytest.raises(ValueError, match="actor.parallel: tp\\*pp = 3 does not divide the 8 devices"):
        engine_parallel(ParallelConfig(tp=3), 8, "actor")
    with pytest.raises(ValueError, match="dp must be 2"):
        engine_parallel(ParallelConfig(tp=2, dp=3), 4, "critic")


def test_engine_config_maps_the_config_tree():
    cfg = load_config(None, ["actor.optim.lr=3e-4", "actor.optim.schedule=cosine", "actor.optim.betas=[0.8, 0.9]",
                             "actor.micro_batch_size_per_device=5", "model.path=x", "resources.n_gpus_per_node=2"], validate=False)  # fmt: skip
    ec = engine_config(cfg.actor, 2, "actor", seed=7, total_steps=30)
    assert (ec.optim.lr, ec.optim.betas, ec.optim.total_steps, ec.optim.schedule) == (
        3e-4,
        [0.8, 0.9],
        30,
        "cosine",
    )
    assert (ec.micro_batch_size_per_device, ec.parallel.dp, ec.seed) == (5, 2, 7)
    assert ec.optim is not cfg.actor.optim and cfg.actor.optim.total_steps == 0  # the config is not mutated
    cfg.actor.optim.schedule, cfg.actor.optim.total_steps = "linear", 12  # a set decay length wins
    ec = engine_config(cfg.actor, 2, "actor", seed=0, total_steps=30)
    assert (ec.optim.schedule, ec.optim.total_steps) == ("linear", 12)


def test_mini_batches_first_epoch_in_order_then_permuted():
    batch = Batch({"x": torch.arange(6)})
    pieces = list(iter_mini_batches(batch, num_mini_batches=3, epochs=2, seed=0))
    assert [p["x"].tolist() for p in pieces[:3]] == [[0, 1], [2, 3], [4, 5]]  # on-policy first pass
    second = torch.cat([p["x"] for p in pieces[3:]])
    assert (
        len(pieces) == 6 and sorted(second.tolist()) == list(range(6)) and second.tolist() != list(range(6))
    )
    assert len(list(iter_mini_batches(batch.index(slice(0, 2)), 4, 1, 0))) == 2  # never an empty piece


def test_dpo_loss_fn_pairs_interleaved_rows_and_sums_masked_tokens():
    cfg = load_config(None, ["model.path=x"], validate=False).algorithm.dpo
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lp = torch.tensor([[-1.0, -1.0, -9.0], [-0.5, -9.0, -9.0]])  # chosen sum -2, rejected sum -0.5
    mb = Batch({"response_mask": mask, "ref_log_probs": torch.zeros(2, 3)})
    loss, _ = dpo_loss_fn(cfg)({"log_probs": lp}, mb)
    assert float(loss) == pytest.approx(-math.log(1 / (1 + math.exp(-cfg.beta * (-2.0 + 0.5)))))


def test_ipo_averages_log_probs_over_tokens():
    """IPO compares token-mean log-probs (IPO paper, TRL): chosen mean -1 over 2 tokens, rejected -0.5
    over 1; reference means -1.5 and -0.25. h = (-1 + 1.5) - (-0.5 + 0.25) = 0.75."""
    cfg = load_config(None, ["model.path=x", "algorithm.dpo.loss_type=ipo", "algorithm.dpo.beta=0.5"],
                      validate=False).algorithm.dpo  # fmt: skip
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lp = torch.tensor([[-1.0, -1.0, -9.0], [-0.5, -9.0, -9.0]])
    ref = torch.tensor([[-1.0, -2.0, -9.0], [-0.25, -9.0, -9.0]])
    loss, m = dpo_loss_fn(cfg)({"log_probs": lp}, Batch({"response_mask": mask, "ref_log_probs": ref}))
    assert float(loss) == pytest.approx((0.75 - 1 / (2 * 0.5)) ** 2)
    assert float(m["reward_margin"]) == pytest.approx(0.5 * 0.75)


def test_actor_loss_adds_entropy_bonus_and_kl_loss():
    cfg = load_config(None, ["model.path=x", "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.5",
                             "algorithm.kl_loss_kind=k1", "algorithm.entropy_coeff=0.1"], validate=False)  # fmt: skip
    mask = torch.ones(2, 2)
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]])
    mb = Batch({"response_mask": mask, "old_log_probs": lp.clone(), "advantages": torch.ones(2, 2),
                "ref_log_probs": lp - 0.2})  # fmt: skip
    entropy = torch.full((2, 2), 3.0)
    loss, m = actor_loss_fn(cfg.actor, cfg.algorithm, 2)({"log_probs": lp, "entropy": entropy}, mb)
    # ratio 1 -> pg loss = -mean(A) = -1; minus 0.1 * entropy 3; plus 0.5 * k1 KL 0.2
    assert float(loss) == pytest.approx(-1.0 - 0.3 + 0.1)
    assert float(m["pg_loss"]) == pytest.approx(-1.0) and float(m["kl_loss"]) == pytest.approx(0.2)
    assert float(m["entropy"]) == pytest.approx(3.0)


def test_mask_padding_zeroes_the_trailing_padding_rows():
    batch = Batch(
        {"response_mask": torch.ones(3, 2, dtype=torch.long)}, meta=BatchMeta(pad_rows=1, temperature=0.7)
    )
    out = mask_padding(batch)
    assert out["response_mask"].tolist() == [[1, 1], [1, 1], [0, 0]]
    assert out.meta.pad_rows == 0 and out.meta.temperature == 0.7  # mini-batches must not re-mask
    assert mask_padding(Batch({"response_mask": torch.ones(2, 2)}))["response_mask"].sum() == 4
