"""Offload once per phase (engines/offload.py). There is no GPU here: `Offloader.active` is forced on,
so every move is a real `.to("cpu")` that costs nothing on this CPU-only machine; what is tested is
which state moves, how often and how many bytes are counted, which is the same code on a GPU."""

from __future__ import annotations

from rl_data import make_rl_batch, pg_loss

from hybridflow.engines import EngineConfig, OptimConfig, TrainEngine
from hybridflow.engines.offload import Offloader
from hybridflow.models import load_causal_lm


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_update_moves_params_and_optimizer_once_each_way(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(Offloader, "active", property(lambda self: True))  # stands in for a GPU
    cfg = EngineConfig(optim=OptimConfig(lr=1e-3), offload=True, micro_batch_size_per_device=2)
    engine = TrainEngine(load_causal_lm(tiny_model_dir), cfg)
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=8, seed=2)
    engine.train_step(batch, pg_loss)  # creates the AdamW moments
    engine.offload_stats()
    params = _bytes(engine.module.parameters())
    moments = _bytes(v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step")
    assert moments == 2 * params

    with engine.phase(optimizer=True):  # a worker's PPO update: 4 mini-batches, 4 optimizer steps
        for mb in batch.split(2):
            engine.train_step(mb, pg_loss)
    stats = engine.offload_stats()
    assert stats["offload_moves"] == 4  # params in, moments in, params out, moments out
    assert stats["offload_bytes"] == 2 * params + 2 * moments

    engine.compute_log_probs(batch)  # a log-prob pass: parameters only
    stats = engine.offload_stats()
    assert stats["offload_moves"] == 2 and stats["offload_bytes"] == 2 * params
    assert not engine._offload.params_home and not engine._offload.optim_home


def test_no_moves_without_offload_or_on_cpu(tiny_model_dir):
    engine = TrainEngine(load_causal_lm(tiny_model_dir), EngineConfig(offload=True))
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=4, seed=1)
    engine.train_step(batch, pg_loss)
    assert engine.offload_stats() == {"offload_s": 0.0, "offload_bytes": 0.0, "offload_moves": 0.0}


def test_offload_off_never_enters_the_offloader(tiny_model_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Offloader entered with offload off")

    monkeypatch.setattr(Offloader, "__init__", refuse)
    engine = TrainEngine(load_causal_lm(tiny_model_dir), EngineConfig(offload=False))
    batch = make_rl_batch(engine.hf_model.config.vocab_size, batch_size=4, seed=1)
    with engine.phase(optimizer=True):
        engine.train_step(batch, pg_loss)
    engine.offload()
    engine.reload(optimizer=True)
    assert engine.offload_stats() == {"offload_s": 0.0, "offload_bytes": 0.0, "offload_moves": 0.0}
