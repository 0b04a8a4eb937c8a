"""The training engine under device-strict mode (hybridflow/controller/strict_device.py) and on the device
it is given: the GPU-only placement bugs made to fail on CPU."""

from __future__ import annotations

import pytest
import torch
from rl_data import make_rl_batch, pg_loss

from hybridflow.config.algorithm_config import AlgorithmConfig
from hybridflow.config.schema import ActorConfig, CriticConfig
from hybridflow.controller import strict_device
from hybridflow.engines import EngineConfig, OptimConfig, TrainEngine
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


def _offload_engine(model_dir, offload: bool) -> TrainEngine:
    cfg = EngineConfig(optim=OptimConfig(lr=1e-2), offload=offload, micro_batch_size_per_device=2)
    return TrainEngine(load_causal_lm(model_dir), cfg, device=strict_device.ACCEL)


def test_offload_moves_state_to_the_host_tier_and_an_offloaded_weight_raises(model_dir):
    """Item 9: on the stand-in accelerator offload runs (as on a GPU): parameters and AdamW moments go to the
    host between phases, so a forward outside a phase meets host weights, and each phase brings them back."""
    with strict_device.strict_scope():
        engine = _offload_engine(model_dir, offload=True)  # offloaded once built
        batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=4, seed=2)
        strict_device.mark_host(batch)
        engine.offload_stats()
        engine.train_step(batch, pg_loss)  # creates the moments, then sends everything out
        params = list(engine.hf_model.parameters())
        moments = [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert {strict_device.tag(t) for t in params + moments} == {strict_device.HOST}
        assert engine.offload_stats()["offload_moves"] == 4  # params in, moments in, both out
        ids = batch["input_ids"].to(strict_device.ACCEL)
        with pytest.raises(strict_device.StrictDeviceError, match="device tensor .* meets a host tensor"):
            engine.hf_model(input_ids=ids)  # the weights used without reload() / phase()
        engine.reload()
        assert {strict_device.tag(p) for p in params} == {strict_device.DEVICE}
        assert engine.hf_model(input_ids=ids).logits.isfinite().all()


def test_offloaded_updates_equal_resident_ones(model_dir):
    """Two updates with the state offloaded between them: the same losses and weights as without offload."""
    runs = {}
    for offload in (False, True):
        with strict_device.strict_scope():
            engine = _offload_engine(model_dir, offload)
            metrics = []
            for seed in (2, 3):
                batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=4, seed=seed)
                strict_device.mark_host(batch)
                metrics.append(engine.train_step(batch, pg_loss))
            runs[offload] = metrics, engine.full_state_dict()
    (want, want_w), (got, got_w) = runs[False], runs[True]
    assert got == want and want[1]["grad_norm"] > 0
    first = load_causal_lm(model_dir).state_dict()
    assert any(not torch.equal(want_w[k], first[k]) for k in first)  # the updates moved the weights
    assert all(torch.equal(got_w[k], want_w[k]) for k in want_w)
