"""reward.fns: several weighted rule rewards in the config tree, typed, printed and checked in one line each."""

from __future__ import annotations

import pytest
import yaml

from hybridflow.config import ConfigError, load_config
from hybridflow.config.cli import to_yaml
from hybridflow.config.schema import RewardFnConfig, reward_fn_name

BASE = ["model.path=m", "data.dataset=synthetic:arithmetic"]
FNS = (
    "reward.fns=[{fn: synthetic:arithmetic, weight: 1.0}, {fn: format, weight: 0.1, fn_kwargs: {fmt: boxed}}]"
)


def test_fns_are_typed_entries_and_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, [*BASE, FNS], check_model=False)
    assert cfg.reward.fns == [
        RewardFnConfig(fn="synthetic:arithmetic", weight=1.0),
        RewardFnConfig(fn="format", weight=0.1, fn_kwargs={"fmt": "boxed"}),
    ]
    assert [reward_fn_name(e) for e in cfg.reward.fns] == ["arithmetic", "format"]
    assert reward_fn_name(RewardFnConfig(fn="my/rewards.py:exact")) == "exact"
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))  # what a run writes as run_dir/config.yaml, and `hybridflow eval` reads
    assert load_config(path, check_model=False).reward.fns == cfg.reward.fns
    assert yaml.safe_load(path.read_text())["reward"]["fns"][1]["weight"] == 0.1


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ([FNS, "reward.fn=gsm8k"], "reward.fns and reward.fn are both set"),
        ([FNS, "reward.fn_kwargs={a: 1}"], "reward.fns and reward.fn_kwargs are both set"),
        (["reward.fns=[{fn: format}, {fn: format}]"], "two entries are named 'format'"),
        (["reward.fns=[{weight: 1.0}]"], "reward.fns[0].fn: empty"),
        (["reward.fns=[{fn: format, weight: .nan}]"], "reward.fns[0].weight: must be a finite number"),
        (["reward.fns=[{fn: format, wieght: 2}]"], "unknown key 'reward.fns[0].wieght' (did you mean"),
    ],
)
def test_mistakes_are_one_line_each(overrides, problem):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*BASE, *overrides], check_model=False)
    assert len(e.value.errors) == 1 and problem in e.value.errors[0], e.value.errors
