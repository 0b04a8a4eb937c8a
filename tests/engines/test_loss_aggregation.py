"""Every loss_agg_mode gives the same gradients however the global mini-batch is split: into micro-batches
(1x8 == 8x1 == 3+3+2) and over dp ranks (2 gloo ranks == 1 process), with the actor's own loss adapter and
the engine weighting it declares (workers/losses.split_aggregation). The reference is the mode computed
on the whole batch in one forward, checked against aggregate_loss by hand below.

Tolerances: fp32 gradients of a tiny model (hidden 64) summed over at most 8 micro-batches in another
order: a few ulps (6e-8) relative per addition, so 1e-4 relative / 1e-6 absolute holds on any CPU kernel;
token-sum's gradients are the token count (~40) times larger, hence the relative bound."""

from __future__ import annotations

import pytest
import torch
from dist_workers import run_group
from rl_data import actor_agg_loss, make_rl_batch

from hybridflow.algorithms import AGG_MODES, aggregate_loss
from hybridflow.engines import EngineConfig, OptimConfig, TrainEngine
from hybridflow.models import load_causal_lm
from hybridflow.models.tiny import save_tiny_model

BATCH = dict(batch_size=8, lp=6, lr=8, seed=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("agg_model"), "tiny", "llama", seed=2))


def _engine(model_dir):
    optim = OptimConfig(lr=1e-2, grad_clip=1.0, eps=1e-6)  # as tests/engines/test_parallel.reference
    return TrainEngine(load_causal_lm(model_dir), EngineConfig(optim=optim, logits_chunk_size=4))


def _grads(engine, batch, mode, **kwargs):
    loss_fn, weighting = actor_agg_loss(mode)
    metrics = engine.forward_backward(batch, loss_fn, loss_weighting=weighting, **kwargs)
    return metrics, dict(engine.iter_full_grads())


@pytest.mark.parametrize("mode", AGG_MODES)
def test_accumulation_1x8_equals_8x1(model_dir, mode):
    engine = _engine(model_dir)
    batch = make_rl_batch(engine.hf_model.config.vocab_size, **BATCH)
    _, full = _grads(engine, batch, mode, micro_batch_size=8)
    for kwargs in ({"micro_batch_size": 1}, {"micro_batch_size": 3}, {"max_tokens": 24}):
        _, got = _grads(engine, batch, mode, **kwargs)
        for name, grad in full.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=f"{mode} {name} {kwargs}")
    assert max(float(g.abs().max()) for g in full.values()) > 0


def test_whole_batch_gradient_is_the_mode_by_hand(model_dir):
    """At ratio 1 the policy loss is -A per token, so d loss / d log_prob is what aggregate_loss gives -A;
    token-sum's is the token-mean's times the batch's token count, Dr. GRPO's is seq-mean-token-sum's over
    the constant 8."""
    engine = _engine(model_dir)
    batch = make_rl_batch(engine.hf_model.config.vocab_size, **BATCH)
    grads = {mode: _grads(engine, batch, mode, micro_batch_size=8)[1] for mode in AGG_MODES}
    tokens = float(batch["response_mask"].sum())
    name = "lm_head.weight" if "lm_head.weight" in grads["token-mean"] else next(iter(grads["token-mean"]))
    torch.testing.assert_close(
        grads["token-sum"][name], grads["token-mean"][name] * tokens, rtol=1e-4, atol=1e-6
    )
    torch.testing.assert_close(grads["seq-mean-token-sum-norm"][name], grads["seq-mean-token-sum"][name] / 8,
                               rtol=1e-4, atol=1e-7)  # fmt: skip
    per_token = -batch["advantages"]
    mask = batch["response_mask"].float()
    assert aggregate_loss(per_token, mask, "token-sum") == pytest.approx(
        float(aggregate_loss(per_token, mask, "token-mean")) * tokens, rel=1e-6
    )


def test_two_dp_ranks_equal_one_process_for_every_mode(model_dir, tmp_path):
    cases = [dict(name=mode, model_dir=model_dir, tp=1, dp=2, batch=BATCH, agg=mode,
                  engine={"micro_batch_size_per_device": 3}) for mode in AGG_MODES]  # fmt: skip
    got = run_group(2, cases, tmp_path)
    for mode in AGG_MODES:
        engine = _engine(model_dir)
        batch = make_rl_batch(engine.hf_model.config.vocab_size, **BATCH)
        _, want = _grads(engine, batch, mode, micro_batch_size=8)
        for name, grad in want.items():
            torch.testing.assert_close(
                got[mode]["grads"][name], grad, atol=1e-6, rtol=1e-4, msg=f"{mode} {name}"
            )
