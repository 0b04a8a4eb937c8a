"""What each algorithm needs is said once (config/algorithms.py): the trainer classes carry the specs,
and the roles they start, validation and the planner bridge all read them. No Ray."""

from __future__ import annotations

import pytest

from hybridflow.config import ConfigError
from hybridflow.config.algorithms import ALGORITHM_SPECS, ALGORITHMS
from hybridflow.config.schema import AlgorithmConfig
from hybridflow.trainers import TRAINERS
from hybridflow.trainers.auto_placement import planner_algorithm, trainer_roles

KL_LOSS = "algorithm.use_kl_loss=true"


def test_every_algorithm_has_one_trainer_carrying_its_spec():
    assert tuple(TRAINERS) == ALGORITHMS
    for name, cls in TRAINERS.items():
        assert cls.spec is ALGORITHM_SPECS[name] and cls.name == name
    choices = next(f for f in AlgorithmConfig.__dataclass_fields__.values() if f.name == "name").metadata
    assert choices["choices"] == ALGORITHMS  # the schema's choices come from the same table


@pytest.mark.parametrize(
    "algorithm,overrides,expected",
    [
        ("ppo", (), ("actor_rollout", "critic")),
        ("ppo", ("algorithm.kl.in_reward=true",), ("actor_rollout", "ref", "critic")),
        ("grpo", (KL_LOSS,), ("actor_rollout", "ref")),
        ("rloo", (), ("actor_rollout",)),
        ("remax", (KL_LOSS,), ("actor_rollout", "ref")),
        ("reinforce_pp", ("reward.kind=model", "model.reward_model_path=RM"), ("actor_rollout", "reward")),
        ("safe_rlhf", ("model.cost_model_path=CM",), ("actor_rollout", "critic", "cost_critic", "cost")),
        ("safe_rlhf", ("algorithm.safe_rlhf.cost_fn=x.py:f", KL_LOSS), ("actor_rollout", "ref", "critic", "cost_critic")),
        ("dpo", (), ("actor_rollout", "ref")),
        ("dpo", ("algorithm.dpo.reference_free=true",), ("actor_rollout",)),
        ("sft", ("algorithm.use_kl_loss=true", "reward.kind=model", "model.reward_model_path=RM"), ("actor_rollout",)),
    ],
)  # fmt: skip
def test_roles_come_from_the_spec(make_config, tiny_model_dir, algorithm, overrides, expected):
    overrides = [
        o.replace("=RM", f"={tiny_model_dir}").replace("=CM", f"={tiny_model_dir}") for o in overrides
    ]
    cfg = make_config(algorithm, *overrides)
    trainer = object.__new__(TRAINERS[algorithm])  # roles() reads only the config and step counts
    trainer.cfg, trainer.total_steps = cfg, 3
    roles = trainer.roles()
    assert tuple(roles) == expected
    if ALGORITHM_SPECS[algorithm].planner:
        assert trainer_roles(cfg) == expected
    else:
        with pytest.raises(ConfigError, match=f"no dataflow for algorithm '{algorithm}'"):
            planner_algorithm(cfg)
    # the optimizer steps of the run, for LR schedules: steps x mini-batches x epochs
    assert (
        roles["actor_rollout"]["total_optim_steps"] == 3 * cfg.actor.num_mini_batches * cfg.actor.ppo_epochs
    )


def test_validation_asks_the_spec(make_config):
    for name, spec in ALGORITHM_SPECS.items():
        if spec.min_n > 1:
            with pytest.raises(ConfigError, match=f"rollout.n: {name} .* needs n >= 2"):
                make_config(name, "rollout.n=1")
    with pytest.raises(ConfigError, match="safe_rlhf needs a cost") as e:
        make_config("safe_rlhf")
    assert len(e.value.errors) == 1
    with pytest.raises(ConfigError, match="has no dataflow for 'sft'"):
        make_config("sft", "resources.placement=auto")
    with pytest.raises(ConfigError, match="'grpo' is not rloo's estimator"):
        make_config("rloo", "algorithm.adv_estimator=grpo")
    assert make_config("rloo", "algorithm.adv_estimator=rloo").algorithm.adv_estimator == "rloo"
    assert make_config("sft").algorithm.adv_estimator == "none"


def test_dpo_pairs_must_divide_the_actor_dp(make_config):
    with pytest.raises(ConfigError) as e:
        make_config("dpo", "data.train_batch_size=3", "actor.ppo_mini_batch_size=3", devices=2)
    assert e.value.errors == [
        "data.train_batch_size: 3 pairs must divide evenly over the actor's dp=2 ranks "
        "(both rows of a pair must land on the same rank)"
    ]
