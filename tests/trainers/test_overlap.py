"""PPO on split pools (actor + reference | critic + reward model): the phases are futures.

The values, reference and reward outputs carry tripwires that raise if unpickled in the driver
(tests/trainers/tripwire_workers.py): a step that completes proves that they reached the advantage
phase and the updates without passing through the driver. The logged busy intervals
(timing_s/timeline/<phase>/{start,end}) of phases on different pools intersect when overlapped, and follow one
another with trainer.overlap_phases=false.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

from hybridflow.controller.timers import Timers
from hybridflow.models import load_reward_model, save_hf_model
from hybridflow.trainers import build_trainer, placement
from tests.trainers.configs import tiny_config
from tests.trainers.test_drivers import _step
from tests.trainers.tripwire_workers import TRIP_CLASSES


def _overrides(rm_dir) -> list[str]:
    return ["reward.kind=model", f"model.reward_model_path={rm_dir}", "resources.placement=split",
            "algorithm.kl.in_reward=true"]  # fmt: skip


@pytest.fixture(scope="module")
def split_ppo(ray_cluster, tiny_model_dir, tmp_path_factory):
    torch.manual_seed(3)
    rm_dir = save_hf_model(load_reward_model(tiny_model_dir), tmp_path_factory.mktemp("rm"))
    cfg = tiny_config(tiny_model_dir, tmp_path_factory.mktemp("runs"), "ppo", *_overrides(rm_dir), devices=2)
    spec = placement._spec

    def tripwired(cfg, role, kwargs, with_ref):
        cls, kw = spec(cfg, role, kwargs, with_ref)
        return TRIP_CLASSES[cls], {**kw, "driver_pid": os.getpid()}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(placement, "_spec", tripwired)
        trainer = build_trainer(cfg)
    with trainer:
        yield trainer, rm_dir


def _span(metrics: dict, phase: str) -> tuple[float, float]:
    return metrics[f"timing_s/timeline/{phase}/start"], metrics[f"timing_s/timeline/{phase}/end"]


def _issued_within(entered: dict, span: dict, first: str, then: str) -> bool:
    """The driver entered phase `then` less than `first`'s busy time after entering `first`: it did not
    wait for `first` (whose calls took at least that long) before issuing `then`."""
    return entered[then] - entered[first] < span[first][1] - span[first][0]


@pytest.fixture
def entered(monkeypatch) -> dict:
    """phase -> when the driver first entered it (time.time()), recorded by Timers.phase."""
    times, phase = {}, Timers.phase
    monkeypatch.setattr(
        Timers, "phase", lambda self, name: (times.setdefault(name, time.time()), phase(self, name))[1]
    )
    return times


def test_split_ppo_phases_skip_the_driver_and_overlap(split_ppo, entered):
    trainer, _ = split_ppo
    assert trainer.groups["critic"].pool is trainer.groups["reward"].pool is not trainer.actor.pool
    batch, metrics = _step(trainer)  # raises if the driver unpickled a values / ref / reward output
    for key in (
        "actor/pg_loss",
        "critic/vf_loss",
        "reward/mean",
        "actor/reward_kl_penalty",
        "advantages/mean",
    ):
        assert math.isfinite(metrics[key]), key
    span = {p: _span(metrics, p) for p in ("values", "ref", "reward", "adv", "update_critic", "update_actor")}
    # the driver issued each phase's successor before the phase ended (its calls are futures); whether the
    # two pools then ran at the same moment is the OS's call on a loaded machine, not the schedule's
    assert _issued_within(entered, span, "values", "ref")
    assert _issued_within(entered, span, "update_critic", "update_actor")
    # the advantage phase consumes all three, so it starts after each has ended
    assert span["adv"][0] >= max(span[p][1] for p in ("values", "ref", "reward"))
    # the wall time the overlap saves depends on free cores (not a test's to assert): bench_overlap.py
    assert metrics["timing_s/overlap/experience"] > 0
    assert metrics["timing_s/values"] <= span["values"][1] - span["values"][0] + 1e-6
    with pytest.raises(Exception, match="driver deserialised"):
        batch["advantages"]  # fetching the finished batch into the driver does trip it


def test_sequential_phases_follow_one_another(split_ppo, tiny_model_dir, tmp_path, entered):
    trainer, rm_dir = split_ppo
    cfg = tiny_config(
        tiny_model_dir, tmp_path, "ppo", *_overrides(rm_dir), "trainer.overlap_phases=false", devices=2
    )
    with build_trainer(cfg, groups=trainer.groups) as sequential:
        _, metrics = _step(sequential)
    order = [_span(metrics, p) for p in ("values", "ref", "reward", "adv", "update_critic", "update_actor")]
    for before, after in zip(order, order[1:]):
        assert before[1] <= after[0]
    span = {p: _span(metrics, p) for p in ("values", "update_critic")}
    assert not _issued_within(entered, span, "values", "ref")  # the check above can fail
    assert not _issued_within(entered, span, "update_critic", "update_actor")
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["critic/vf_loss"])
