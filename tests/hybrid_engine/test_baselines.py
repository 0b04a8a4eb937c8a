"""The paper's baseline switch methods live apart from the core (hybrid_engine/baselines.py): nothing a
run imports pulls them in, and `rollout.reshard` reaches each one by name. Their numbers (bytes equal to
cost.fsdp_switch_cost, rollouts equal to tp = 1) are checked in test_reshard_workers.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridflow.hybrid_engine.cost import METHODS
from hybridflow.hybrid_engine.resharder import Resharder, build_resharder


def test_a_run_imports_no_baseline():
    code = (
        "import sys, hybridflow.workers.actor, hybridflow.trainers.ppo, hybridflow.hybrid_engine;"
        "print('hybridflow.hybrid_engine.baselines' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "False"


def test_every_method_has_one_resharder_class():
    from hybridflow.hybrid_engine.baselines import BASELINES

    assert {Resharder.method, *BASELINES} == set(METHODS)
    assert all(issubclass(cls, Resharder) and cls.method == name for name, cls in BASELINES.items())


def test_an_unknown_method_is_named_before_any_engine_is_touched():
    with pytest.raises(ValueError, match="unknown method 'allgatherx'.*hybridflow"):
        build_resharder(None, "allgatherx")


def test_the_formula_is_computed_once_per_layout(tiny_model_dir, monkeypatch):
    """A one-rank engine (no mesh): two rounds, one call of the formula, the same figures both rounds."""
    from hybridflow.engines import EngineConfig, TrainEngine
    from hybridflow.hybrid_engine import cost, resharder
    from hybridflow.models import load_causal_lm

    calls = []

    def counted(*args):
        calls.append(args)
        return cost.fsdp_switch_cost(*args)

    monkeypatch.setattr(resharder, "fsdp_switch_cost", counted)
    engine = TrainEngine(load_causal_lm(tiny_model_dir), EngineConfig())
    r = build_resharder(engine)
    figures = []
    for _ in range(2):
        with r.generation() as (weights, group):
            assert group is None and set(weights) == {n for n, _ in engine.hf_model.named_parameters()}
        figures.append((r.stats.formula_bytes, r.stats.formula_gen_weight_bytes))
    assert len(calls) == 1 and figures[0] == figures[1] and figures[0][1] > 0
