"""The training engine under device-strict mode (hybridflow/controller/strict_device.py) and on the device
it is given: the GPU-only placement bugs made to fail on CPU."""

from __future__ import annotations

import pytest
import torch
from rl_data import make_rl_batch

from hybridflow.config.algorithm_config import AlgorithmConfig
from hybridflow.config.schema import ActorConfig, CriticConfig
from hybridflow.controller import strict_device
from hybridflow.engines import EngineConfig, TrainEngine
from hybridflow.models import load_causal_lm, load_critic
from hybridflow.models.tiny import save_tiny_model
from hybridflow.workers.losses import actor_loss_fn, critic_loss_fn, sft_loss


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("strict_engine"), "tiny", "llama", seed=1)


def _rl_fields(batch):
    """What the trainer adds before an update: advantages, old/ref/rollout log-probs, values, returns."""
    g = torch.Generator().manual_seed(0)
    for key in ("advantages", "old_log_probs", "ref_log_probs", "rollout_log_probs", "values", "returns"):
        batch[key] = -torch.rand(batch["responses"].shape, generator=g)
    return batch


@pytest.mark.parametrize("role", ["actor", "critic", "sft"])
def test_updates_read_every_loss_field_on_the_device(model_dir, role):
    """G1: the loss reads advantages / old, ref and rollout log-probs / returns beside the device outputs; on
    a GPU each must be on the device, not only the model inputs."""
    algo = AlgorithmConfig(use_kl_loss=True)
    loss_fn = {
        "actor": actor_loss_fn(ActorConfig(), algo, 8, correct=True),
        "critic": critic_loss_fn(CriticConfig(), "values", "returns", 8),
        "sft": sft_loss,
    }[role]
    with strict_device.strict_scope():
        model = (load_critic if role == "critic" else load_causal_lm)(model_dir)
        engine = TrainEngine(model, EngineConfig(micro_batch_size_per_device=3), device=strict_device.ACCEL)
        batch = _rl_fields(make_rl_batch(model.config.vocab_size, batch_size=5, seed=2))
        if role == "actor":  # old = current log-probs: ratios near 1, so the clipped loss has a gradient
            batch["old_log_probs"] = batch["rollout_log_probs"] = engine.compute_log_probs(batch)[0]
        strict_device.mark_host(batch)  # as it arrives from the driver
        metrics = engine.train_step(batch, loss_fn, with_entropy=role == "actor")
    assert metrics["grad_norm"] > 0 and all(isinstance(v, float) for v in metrics.values())


def test_a_host_tensor_against_a_device_output_raises_naming_the_op(model_dir):
    """What the strict mode reports for the bug G1 was: a loss field left on the host."""

    def leaky(out, mb):
        return (out["log_probs"] * torch.ones(out["log_probs"].shape)).mean(), {}

    with strict_device.strict_scope():
        engine = TrainEngine(load_causal_lm(model_dir), device=strict_device.ACCEL)
        batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=2)
        strict_device.mark_host(batch)
        with pytest.raises(
            strict_device.StrictDeviceError, match=r"Tensor.mul: a device tensor .* host tensor"
        ):
            engine.train_step(batch, leaky)


def test_the_engine_computes_on_the_device_it_is_given_on_a_gpu_host(model_dir, monkeypatch):
    """resources.device=cpu on a GPU host computes on CPU: the engine never asks torch.cuda which device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("current_device", "_lazy_init", "set_device"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: pytest.fail(f"torch.cuda.{_n} called"))
    engine = TrainEngine(load_causal_lm(model_dir), EngineConfig(mixed_precision="auto"), trainable=False)
    assert engine.device == torch.device("cpu") and engine.compute_dtype is None  # fp32 on CPU
    lp, _ = engine.compute_log_probs(make_rl_batch(engine.hf_model.config.vocab_size, batch_size=2))
    assert lp.device.type == "cpu" and torch.isfinite(lp).all()
