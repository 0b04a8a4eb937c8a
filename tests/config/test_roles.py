"""Each worker is built with its role's part of the config tree only (config/roles.py)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.config.roles import (
    ActorWorkerConfig,
    CriticWorkerConfig,
    RewardWorkerConfig,
    worker_config,
)

BASE = ["model.path=m", "data.dataset=synthetic:arithmetic", "algorithm.name=ppo"]
# role -> (its config class, the tree's sections it holds)
EXPECTED = {
    "actor_rollout": (ActorWorkerConfig, {"model", "actor", "rollout", "ref", "algorithm"}),
    "rollout": (ActorWorkerConfig, {"model", "actor", "rollout", "ref", "algorithm"}),
    "ref": (ActorWorkerConfig, {"model", "actor", "rollout", "ref", "algorithm"}),
    "critic": (CriticWorkerConfig, {"model", "critic"}),
    "cost_critic": (CriticWorkerConfig, {"model", "critic"}),
    "reward": (RewardWorkerConfig, {"model", "reward"}),
    "cost": (RewardWorkerConfig, {"model", "reward"}),
}
# settings each kind of worker does not read: changing them must leave its config equal
UNRELATED = {
    ActorWorkerConfig: ["critic.optim.lr=0.5", "reward.fn=gsm8k", "trainer.total_steps=7",
                        "trainer.save_every=3", "data.shuffle=false", "critic.ppo_epochs=4"],
    CriticWorkerConfig: ["actor.optim.lr=0.5", "rollout.temperature=0.3", "reward.fn=gsm8k",
                         "trainer.total_steps=7", "algorithm.entropy_coeff=0.1", "ref.offload=true"],
    RewardWorkerConfig: ["actor.optim.lr=0.5", "critic.optim.lr=0.5", "rollout.n=3",
                         "trainer.total_steps=7", "algorithm.gamma=0.5", "data.train_batch_size=16"],
}  # fmt: skip
# a setting each kind reads: changing it must reach it
RELATED = {
    ActorWorkerConfig: "actor.optim.lr=0.5",
    CriticWorkerConfig: "critic.optim.lr=0.5",
    RewardWorkerConfig: "reward.micro_batch_size_per_device=3",
}


def config(*overrides: str) -> HybridFlowConfig:
    return load_config(None, [*BASE, *overrides], check_model=False)


def section_types(cls) -> set[type]:
    """Every dataclass type reachable from `cls`'s fields."""
    out = set()
    for t in typing.get_type_hints(cls).values():
        if dataclasses.is_dataclass(t):
            out |= {t} | section_types(t)
    return out


@pytest.mark.parametrize("role", sorted(EXPECTED))
def test_a_worker_config_holds_only_its_roles_sections(role):
    cls, sections = EXPECTED[role]
    wc = worker_config(config(), role)
    assert type(wc) is cls
    held = {f.name for f in dataclasses.fields(wc) if dataclasses.is_dataclass(getattr(wc, f.name))}
    assert held == sections
    tree = typing.get_type_hints(HybridFlowConfig)
    others = {tree[name] for name in tree} - {tree[name] for name in sections}
    assert not section_types(cls) & (others | {HybridFlowConfig}), "another role's section leaked in"
    for name in sections:  # the tree's own sections, copied: same values, not the same objects
        assert getattr(wc, name) == getattr(config(), name)


@pytest.mark.parametrize("cls", [ActorWorkerConfig, CriticWorkerConfig, RewardWorkerConfig])
def test_an_unrelated_setting_does_not_reach_a_worker(cls):
    role = next(r for r, (c, _) in EXPECTED.items() if c is cls)
    before = worker_config(config(), role)
    for override in UNRELATED[cls]:
        assert worker_config(config(override), role) == before, override
    assert worker_config(config(RELATED[cls]), role) != before
    assert worker_config(config("trainer.seed=5"), role).seed == 5


def test_the_actor_reads_its_run_settings_from_the_tree():
    wc = worker_config(
        config("trainer.rollout_ahead=1", "resources.device=cpu", "resources.n_gpus_per_node=2",
               "data.train_batch_size=8", "data.val_batch_size=24", "data.max_prompt_length=40"),
        "rollout",
    )  # fmt: skip
    assert (wc.device, wc.max_prompt_length, wc.prompts_per_step) == ("cpu", 40, 24)
    # the rollout correction weighs the tokens in every run (docs/metrics.md): no rollout_ahead switch
    assert not hasattr(wc, "rollout_ahead")
    assert worker_config(config("rollout.response_length=12"), "critic").response_length == 12


def test_a_worker_config_is_a_copy():
    cfg = config()
    wc = worker_config(cfg, "actor_rollout")
    cfg.actor.optim.lr, cfg.model.dtype = 0.25, "bfloat16"
    assert wc.actor.optim.lr != 0.25 and wc.model.dtype == "auto"


def test_placement_builds_each_worker_with_its_roles_config():
    from hybridflow.trainers.placement import _spec
    from hybridflow.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

    cfg = config("model.cost_model_path=cost", "model.reward_model_path=rm")
    classes = {"actor_rollout": ActorRolloutRefWorker, "rollout": ActorRolloutRefWorker,
               "ref": ActorRolloutRefWorker, "critic": CriticWorker, "cost_critic": CriticWorker,
               "reward": RewardModelWorker, "cost": RewardModelWorker}  # fmt: skip
    for role, (cls, _) in EXPECTED.items():
        worker, kwargs = _spec(cfg, role, {}, with_ref=False)
        assert worker is classes[role] and type(kwargs["config"]) is cls, role
    assert _spec(cfg, "cost", {}, False)[1]["model_path"] == "cost"
    assert _spec(cfg, "reward", {}, False)[1]["model_path"] == "rm"


def test_an_unknown_role_is_an_error():
    with pytest.raises(ValueError, match="unknown role 'critc'"):
        worker_config(config(), "critc")
