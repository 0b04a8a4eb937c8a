"""A checkpoint holding a NaN/inf weight or optimizer moment is never written: the save is refused in one
line naming the tensor, nothing is committed or pruned, and the last finite checkpoint stays `latest`
(keep_last=2 would otherwise have deleted it two saves later). A real tiny model, engine and manager."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import engine_config, make_batch, pg_loss

from hybridflow.checkpoint import save_engine_state
from hybridflow.checkpoint.manager import CheckpointManager, CheckpointNotFinite
from hybridflow.engines import TrainEngine
from hybridflow.models import load_causal_lm


def _save(manager: CheckpointManager, engine: TrainEngine, step: int) -> None:
    with manager.writing(step) as tmp:
        save_engine_state(engine, tmp / "actor")


@pytest.mark.parametrize("poison", ["weight", "moment"])
def test_a_non_finite_tensor_is_never_saved_and_the_good_checkpoints_stay(tiny_model_dir, tmp_path, poison):
    engine = TrainEngine(load_causal_lm(tiny_model_dir), engine_config())
    batch = make_batch(engine.hf_model.config.vocab_size)
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2):
        engine.train_step(batch, pg_loss)
        _save(manager, engine, step)
    name, param = next(iter(engine.hf_model.named_parameters()))
    with torch.no_grad():
        if poison == "weight":
            param[0, 0] = float("nan")
        else:
            engine.optimizer.state[param]["exp_avg_sq"].fill_(float("inf"))
    for step in (3, 4):  # was: both written, and step_1, step_2 (the last finite one) pruned
        with pytest.raises(CheckpointNotFinite) as info:
            _save(manager, engine, step)
        line = str(info.value)
        assert "\n" not in line and f"checkpoint of step {step} not saved" in line and "not finite" in line
        assert "step_2 and `latest` are intact" in line
        assert (name if poison == "weight" else "exp_avg_sq") in line
    assert manager.steps() == [1, 2] and manager.latest_step() == 2
    assert [p.name for p in manager.dir.iterdir() if p.name.startswith(".")] == []  # no temp left
    manager.validate(manager.latest())
