"""Sharded init in one process (the 4-rank bounds are in tests/checkpoint/test_sharded.py): a meta-built
model holds no storage until the engine materialises it, then equals the fully loaded model; a critic
built from a causal-LM directory gets the backbone from disk and a zero value head; a directory whose
safetensors lack a parameter falls back to a full load."""

from __future__ import annotations

import json

import torch

from hybridflow.engines import EngineConfig, TrainEngine
from hybridflow.models import init_critic_from_causal_lm, load_causal_lm, load_critic


def test_meta_model_materialises_to_the_loaded_weights(tiny_model_dir):
    meta = load_causal_lm(tiny_model_dir, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    assert not any(b.is_meta for b in meta.buffers())  # rotary tables are computed, not stored
    engine = TrainEngine(meta, EngineConfig())
    full = load_causal_lm(tiny_model_dir)
    for (name, a), b in zip(engine.hf_model.state_dict().items(), full.state_dict().values()):
        assert torch.equal(a, b), name
    assert engine.init_stats.bytes_read == engine.init_stats.full_model_bytes  # one rank reads it all


def test_critic_from_causal_lm_on_meta_has_zero_head(tiny_model_dir):
    engine = TrainEngine(load_critic(tiny_model_dir, device="meta"), EngineConfig())
    reference = init_critic_from_causal_lm(tiny_model_dir)
    for (name, a), b in zip(engine.hf_model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    assert engine.init_stats is not None and not engine.hf_model.score.weight.any()


def test_missing_weights_fall_back_to_a_full_load(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tiny_model_dir / "model.safetensors")
    tensors.pop("model.norm.weight")  # transformers initialises it; slices cannot be read
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_causal_lm(tmp_path, device="meta")
    assert not any(p.is_meta for p in model.parameters())
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
