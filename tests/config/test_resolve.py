"""Batch arithmetic and dp sizes are derived once, in resolve_config; readers take the resolved values."""

from __future__ import annotations

import pytest
import yaml

from hybridflow.config import ConfigError, config_to_dict, load_config
from hybridflow.config.cli import to_yaml

BASE = ["model.path=m", "data.dataset=synthetic:arithmetic"]


def _load(*overrides, **kwargs):
    return load_config(None, [*BASE, *overrides], check_model=False, **kwargs)


def test_mini_batch_counts_are_derived():
    cfg = _load("data.train_batch_size=8", "actor.ppo_mini_batch_size=2")
    assert (cfg.actor.num_mini_batches, cfg.critic.ppo_mini_batch_size, cfg.critic.num_mini_batches) == (
        4,
        2,
        4,
    )
    cfg = _load("data.train_batch_size=8", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=4")
    assert (cfg.actor.num_mini_batches, cfg.critic.num_mini_batches) == (4, 2)


def test_dp_sizes_are_derived_from_the_placement():
    cfg = _load("resources.n_gpus_per_node=4", "actor.parallel.tp=2")
    assert (cfg.actor.parallel.dp, cfg.critic.parallel.dp, cfg.ref.parallel.dp) == (2, 4, 4)
    # split: actor + ref on the larger half (3 of 5), critic + reward on the other 2
    cfg = _load("resources.n_gpus_per_node=5", "resources.placement=split")
    dps = [getattr(cfg, s).parallel.dp for s in ("actor", "ref", "critic", "reward")]
    assert dps == [3, 3, 2, 2]
    # auto: the planner decides; the plan's sizes go into each role's config (trainers/placement.py)
    assert _load("resources.n_gpus_per_node=4", "resources.placement=auto").actor.parallel.dp == 0


def test_a_wrong_dp_or_derived_value_is_one_line():
    with pytest.raises(ConfigError) as e:
        _load("resources.n_gpus_per_node=4", "resources.placement=split", "critic.parallel.dp=4")
    assert e.value.errors == [
        "critic.parallel.dp: its pool has 2 devices and tp*pp = 1, so dp must be 2 (or 0 to derive it), got 4"
    ]
    with pytest.raises(ConfigError) as e:
        _load("data.train_batch_size=8", "actor.ppo_mini_batch_size=2", "actor.num_mini_batches=3")
    assert e.value.errors == [
        "actor.num_mini_batches: is derived (data.train_batch_size / ppo_mini_batch_size optimizer steps "
        "per epoch = 4), got 3; remove it and set what it derives from"
    ]
    with pytest.raises(ConfigError) as e:
        _load("data.train_batch_size=10", "actor.ppo_mini_batch_size=4")
    assert e.value.errors == [
        "actor.ppo_mini_batch_size: data.train_batch_size 10 is not divisible by 4; choose a divisor (e.g. 5)"
    ]


def test_resolved_config_reloads_and_rederives(tmp_path):
    """run_dir/config.yaml (what `hybridflow eval` reads) holds the derived values; loading it again
    agrees, and a programmatic change is re-derived rather than left stale."""
    cfg = _load("data.train_batch_size=8", "actor.ppo_mini_batch_size=2")
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(path, check_model=False)
    assert config_to_dict(again) == config_to_dict(cfg)
    assert yaml.safe_load(path.read_text())["actor"]["num_mini_batches"] == 4
    again.actor.ppo_mini_batch_size = 4
    from hybridflow.config import resolve_config

    assert resolve_config(again).actor.num_mini_batches == 2
