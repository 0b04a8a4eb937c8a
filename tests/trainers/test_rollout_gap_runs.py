"""The train-vs-rollout log-prob gap (rollout/log_prob_diff_mean, _max) logged by real one-step runs of the
tiny model on a local Ray cluster: its size in fp32 and bf16, and its reduction over two dp ranks.

Tolerances come from the dtypes, not from one machine's run (they must hold on any x86 CPU, with or
without AVX-512 / AMX, whose kernels sum in different orders):
  fp32: both sides run the same fp32 math (hidden 64, 2 layers, vocab ~30) in different reduction
        orders. Each logit then carries a relative rounding of a few ulps (2^-24 ~ 6e-8) times the length
        of the dot products (64, 128: ~1e-5 relative at worst), on logits of size ~1-10, and a log-prob
        inherits the difference of two of them: far below 1e-4 per token, even at the max.
  bf16: 8 bits of mantissa, so each rounding is up to 2^-9 ~ 2e-3 relative; the rollout (bf16 weights,
        KV-cached decode) and the update's forward (bf16 copies of fp32 master weights) round at different
        places, so log-probs of size ~1-3 differ by ~1e-4-1e-2 per token: the mean is above 1e-4
        (measurably more than fp32's) and far below 0.1; one token's max below 0.5.
The rollout_corr/* metrics follow from the per-token log-ratio d: k3 = e^d - 1 - d ~ d^2 / 2, so fp32's
|d| < 1e-4 bounds it by 5e-9 and the k1 KL by 1e-4, and bf16's mean |d| > 1e-4 puts k3's mean above
(1e-4)^2 / 2 * 0.9 by Jensen (0.9: e^d - 1 - d >= 0.9 d^2 / 2 for |d| < 0.5); the effective sample size
is 1 - O(var d), 1 within 1e-7 in fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.algorithms.rollout_correction import gap_metrics, log_prob_gap_stats
from hybridflow.models.tiny import save_tiny_model
from hybridflow.trainers import build_trainer
from hybridflow.trainers.sources import old_log_prob_source
from tests.trainers.configs import tiny_config

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
ONE_STEP = (DIGITS, "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.val_every=0")
MEAN, MAX = "rollout/log_prob_diff_mean", "rollout/log_prob_diff_max"


def _step(cfg):
    """One training step: (the finished batch, fetched into the driver; the step's metrics)."""
    with build_trainer(cfg) as trainer:
        batch = trainer.train_loader.next_batch()
        trainer.global_step = 1
        batch.meta.global_step = 1
        out, metrics = trainer.train_step(batch)
        return out.fetch(), metrics


@pytest.fixture(scope="module")
def gpt2_model_dir(tmp_path_factory):
    """GPT-2 has no functional decoder here: generation takes the HF fallback (rollout/hf_decoder.py)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_gpt2"), size="tiny", arch="gpt2", seed=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp32_gap_is_rounding_only(ray_cluster, tiny_model_dir, gpt2_model_dir, tmp_path, arch):
    """fp32, synchronous, one optimizer step: the old log-probs are the rollout's own ("rollout"), so
    the update's forward is the training side; built-in decoder (llama) and HF fallback (gpt2)."""
    model = tiny_model_dir if arch == "llama" else gpt2_model_dir
    cfg = tiny_config(model, tmp_path, "grpo", *ONE_STEP)
    assert old_log_prob_source(cfg) == "rollout"
    _, metrics = _step(cfg)
    assert 0.0 <= metrics[MEAN] <= metrics[MAX] < 1e-4  # bound: module docstring
    assert metrics["rollout/probs_diff_max"] < 1e-4
    assert 0.0 <= metrics["rollout_corr/k3_kl"] < 5e-9 and abs(metrics["rollout_corr/kl"]) < 1e-4
    assert (
        abs(metrics["rollout_corr/ppl_ratio"] - 1) < 1e-4 and abs(metrics["rollout_corr/chi2_token"]) < 3e-4
    )
    assert 1 - 1e-7 < metrics["rollout_corr/rollout_is_eff_sample_size"] <= 1 + 1e-12
    assert abs(metrics["actor/is_weight_mean"] - 1) < 1e-4 and metrics["actor/is_weight_clipfrac"] == 0.0


def test_bf16_gap_is_larger_but_bounded(ray_cluster, tiny_model_dir, tmp_path):
    """bf16: the old log-probs come from the update's own forward ("update"), so actor/ppo_kl is 0 and
    says nothing about the rollout; the gap, from that same forward, does."""
    cfg = tiny_config(tiny_model_dir, tmp_path, "grpo", *ONE_STEP, "model.dtype=bfloat16")
    assert old_log_prob_source(cfg) == "update"
    _, metrics = _step(cfg)
    assert metrics["actor/ppo_kl"] == 0.0
    assert 1e-4 < metrics[MEAN] < 0.1 and metrics[MEAN] <= metrics[MAX] < 0.5  # bounds: module docstring
    assert 0.9 * 1e-8 / 2 < metrics["rollout_corr/k3_kl"] < 0.1
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] < 1 - 1e-9
    # the default correction (token TIS, cap 2) weighs the tokens by the ratio: not all 1 here
    assert 0 < abs(metrics["actor/is_weight_mean"] - 1) < 0.1


def test_two_dp_ranks_log_the_whole_batch_gap(ray_cluster, tiny_model_dir, tmp_path):
    """3 rows over dp = 2 (one rank holds a padding row), bf16, two epochs: the old log-probs come from a
    separate actor forward ("actor"), which is the training side. The logged gap must be the whole
    batch's, recomputed here from the finished batch: the token-weighted mean (not the mean of the
    ranks' means) and the max over both ranks."""
    cfg = tiny_config(tiny_model_dir, tmp_path, "reinforce_pp", *ONE_STEP, "model.dtype=bfloat16",
                      "data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "rollout.n=1",
                      "actor.ppo_epochs=2", devices=2)  # fmt: skip
    assert old_log_prob_source(cfg) == "actor" and cfg.actor.parallel.dp == 2
    batch, metrics = _step(cfg)
    assert len(batch) == 3
    expect = gap_metrics(
        log_prob_gap_stats(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
    )
    assert expect[MEAN] > 1e-4  # bf16: a gap to reduce, not zeros
    for k, v in expect.items():
        assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k  # float64 sums in another order
