"""The optimizer step never applies a bad value: a non-finite learning rate or loss skips the update as a
non-finite gradient norm does (weights untouched and finite, `step_skipped` 1), and an update that makes a
weight non-finite anyway is reported (`params_nonfinite` 1). A real tiny model and AdamW."""

from __future__ import annotations

import math

import torch
from rl_data import make_rl_batch

from hybridflow.engines import EngineConfig, OptimConfig, TrainEngine
from hybridflow.engines.optim import params_finite
from hybridflow.models import load_causal_lm


def _loss(out, mb):
    mask = mb["response_mask"][:, : out["log_probs"].shape[1]].float()
    return -(out["log_probs"] * mask).sum() / mask.sum(), {}


def _nan_loss(out, mb):  # the gradient is _loss's (a constant added), the loss itself NaN
    loss, metrics = _loss(out, mb)
    return loss + torch.tensor(float("nan")), metrics


def _setup(model_dir, **optim):
    model = load_causal_lm(model_dir)
    cfg = EngineConfig(micro_batch_size_per_device=8, optim=OptimConfig(**{"lr": 1e-2, **optim}))
    return TrainEngine(model, cfg), make_rl_batch(model.config.vocab_size, batch_size=8, seed=3, group=4)


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.hf_model.named_parameters()}


def _unchanged(engine, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[n]) for n, p in engine.hf_model.named_parameters())


def test_a_nan_learning_rate_skips_the_update(tiny_model_dir):
    engine, batch = _setup(tiny_model_dir, schedule="linear", total_steps=4)
    # a bad value that got past the config's checks: the schedule's lr turns NaN from step 1 on
    engine.config.optim.min_lr_ratio = float("nan")
    first = engine.train_step(batch, _loss)
    assert first["step_skipped"] == 0 and first["lr"] == 1e-2
    before = _weights(engine)
    second = engine.train_step(batch, _loss)
    assert math.isnan(second["lr"]) and math.isfinite(second["grad_norm"])
    assert second["step_skipped"] == 1 and second["params_nonfinite"] == 0
    assert _unchanged(engine, before) and params_finite(engine.hf_model.parameters())
    assert engine.global_step == 2  # the schedule moves on, as after a non-finite gradient norm


def test_a_nan_loss_with_finite_gradients_skips_the_update(tiny_model_dir):
    engine, batch = _setup(tiny_model_dir)
    before = _weights(engine)
    out = engine.train_step(batch, _nan_loss)
    assert math.isnan(out["loss"]) and math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    assert out["step_skipped"] == 1 and _unchanged(engine, before)
    assert engine.train_step(batch, _loss)["step_skipped"] == 0 and not _unchanged(engine, before)


def test_an_update_that_overflows_a_weight_is_reported(tiny_model_dir):
    engine, batch = _setup(tiny_model_dir, lr=1e39, weight_decay=0.0)  # finite as a float, not as fp32
    out = engine.train_step(batch, _loss)
    assert out["step_skipped"] == 0 and out["params_nonfinite"] == 1
    assert not params_finite(engine.hf_model.parameters())
