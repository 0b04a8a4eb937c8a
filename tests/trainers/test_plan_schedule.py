"""A plan's schedule in the trainer (hybridflow/trainers/plan_schedule.py, docs/planner.md): a one-step-
ahead plan adds the `rollout` pool, and the plan's rollout_ahead must match trainer.rollout_ahead.

No Ray. trainer.rollout_ahead is set on the config object directly, so these run whether or not this
build's TrainerConfig declares the setting (issue 14 item 2); where it does not, a one-step-ahead plan
is refused with what to do.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from hybridflow.config import ConfigError
from hybridflow.planner import ClusterSpec, ModelSpec, Plan, WorkloadSpec, build_dataflow, plan
from hybridflow.trainers.auto_placement import (
    ENGINE_LIMITS,
    RoleParallel,
    plan_for_config,
)
from hybridflow.trainers.placement import placement_from_plan
from hybridflow.trainers.plan_schedule import check_schedule

KL_LOSS = "algorithm.use_kl_loss=true"


def _plan(model_dir, devices: int, schedule: str, frozen_pool: str = "auto") -> Plan:
    """`hybridflow plan --model-config DIR --gpu cpu --gpus N --algorithm grpo --no-reward-model
    --schedule S` for tests/trainers/configs.py's batch."""
    df = build_dataflow("grpo", ModelSpec.from_hf_config(model_dir), reward_model=False)
    wl = WorkloadSpec(
        prompts=4, samples_per_prompt=2, prompt_len=16, response_len=4, mini_batches=1,
        micro_batch_size=4, inference_micro_batch_size=8,
    )  # fmt: skip
    cluster = ClusterSpec.build("cpu", devices, devices)
    return plan(df, cluster, wl, limits=ENGINE_LIMITS, schedule=schedule, frozen_pool=frozen_pool)


def _config(make_config, ahead: int | None, *overrides: str, devices: int = 3):
    cfg = make_config("grpo", KL_LOSS, *overrides, devices=devices)
    cfg.trainer.rollout_ahead = ahead
    return cfg


def test_one_step_ahead_plan_adds_the_rollout_pool(make_config, tiny_model_dir):
    p = _plan(tiny_model_dir, 3, "ahead")
    r = p.ahead
    assert p.rollout_ahead == 1 and r.first_device == sum(pool.n_devices for pool in p.pools)
    placement = placement_from_plan(p, _config(make_config, 1))
    assert placement.pools == {**{pool.name: pool.n_devices for pool in p.pools}, "rollout": r.n_devices}
    assert placement.num_devices == 3 and placement.pool_of("rollout") == "rollout"
    assert r.tg == 1  # the tiny model on CPU: replicas beat tensor parallelism
    assert placement.parallel["rollout"] == RoleParallel(1, 1, r.n_devices, 1, 1)
    # the training side runs where the plan put it; the actor no longer generates there
    assert placement.roles["actor_rollout"] == p.model("actor").pool
    assert p.model("actor").stage_seconds["generation"] == 0.0


def test_the_plan_schedule_must_match_the_config(make_config, tiny_model_dir):
    ahead, sync = _plan(tiny_model_dir, 3, "ahead"), _plan(tiny_model_dir, 3, "sync")
    with pytest.raises(
        ConfigError, match=r"has rollout_ahead: 1 but trainer.rollout_ahead=0; .*--schedule sync"
    ):
        placement_from_plan(ahead, _config(make_config, 0))
    with pytest.raises(
        ConfigError, match=r"has rollout_ahead: 0 but trainer.rollout_ahead=1; .*--schedule ahead"
    ):
        placement_from_plan(sync, _config(make_config, 1))
    # a build without the setting runs synchronous plans only
    no_setting = SimpleNamespace(trainer=SimpleNamespace())
    assert check_schedule(sync, no_setting, "p.yaml") == []
    (msg,) = check_schedule(ahead, no_setting, "p.yaml")
    assert "no trainer.rollout_ahead" in msg and "--schedule sync" in msg
    # the rollout pool counts towards the devices, and its layout must be one the engines run
    with pytest.raises(ConfigError, match=r"needs 3 devices \(.*rollout:1\) but .* = 2"):
        placement_from_plan(ahead, _config(make_config, 1, devices=2))
    bad = copy.deepcopy(ahead)
    bad.ahead.tg, bad.ahead.pg = 3, 2
    cfg = _config(make_config, 1)
    cfg.resources.rollout_devices = (
        2 + ahead.ahead.n_devices
    )  # the user's split, which the plan does not have
    errors = check_schedule(bad, cfg, "p.yaml")
    assert len(errors) == 3
    assert "run pipelines of pg <= 1" in errors[0]
    assert f"tg must divide its {ahead.ahead.n_devices} devices" in errors[1]
    assert f"resources.rollout_devices={cfg.resources.rollout_devices} differs" in errors[2]
    # generation TP on the rollout pool (rollout/pool_tp.py) splits whole heads, KV heads and MLP columns
    bad.ahead.pg, bad.ahead.n_devices = 1, 4
    cfg.resources.rollout_devices = 0
    bad.ahead.tg = 4  # the tiny model has 2 KV heads
    (msg,) = check_schedule(bad, cfg, "p.yaml")
    assert "tg must divide the model's {'kv_heads': 2}" in msg and "--engines builtin" in msg
    bad.ahead.tg = 2
    assert check_schedule(bad, cfg, "p.yaml") == []


def test_the_plan_places_the_frozen_models_where_it_priced_them(make_config, tiny_model_dir):
    on_rollout = _plan(tiny_model_dir, 3, "ahead", "rollout")
    r = on_rollout.ahead
    assert r.frozen_pool == "rollout" and r.frozen == ["reference"] and r.scoring_seconds > 0
    placement = placement_from_plan(on_rollout, _config(make_config, 1))  # resources.frozen_pool=auto
    assert placement.pool_of("ref") == "rollout" and placement.parallel["ref"] == RoleParallel(
        1, 1, r.n_devices
    )
    in_training = _plan(tiny_model_dir, 3, "ahead", "training")
    assert in_training.ahead.frozen == [] and in_training.ahead.scoring_seconds == 0.0
    placement = placement_from_plan(in_training, _config(make_config, 1))
    assert placement.pool_of("ref") == in_training.model("reference").pool != "rollout"
    # a config that pins the place refuses a plan that priced the other one, in one line
    cfg = _config(make_config, 1)
    cfg.resources.frozen_pool = "training"
    with pytest.raises(ConfigError, match=r"frozen models .* in the rollout pool but resources.frozen_pool="
                       r"training; set resources.frozen_pool=rollout or re-plan .*--frozen-pool training"):  # fmt: skip
        placement_from_plan(on_rollout, cfg)
    # a plan file written before the choice loads, with the frozen models in the training pool
    old = in_training.to_dict()
    for key in ("frozen_pool", "frozen", "scoring_seconds"):
        del old["ahead"][key]
    assert Plan.from_dict(old) == in_training


def test_auto_plans_the_schedule_the_config_asks_for(make_config):
    p = plan_for_config(_config(make_config, 1, "resources.placement=auto"))
    assert p.rollout_ahead == 1 and p.iteration_seconds == p.ahead.iteration_seconds
    q = plan_for_config(_config(make_config, 0, "resources.placement=auto"))
    assert q.rollout_ahead == 0 and q.iteration_seconds == q.synchronous_seconds
    assert q.ahead == p.ahead  # searched anyway, for the note comparing the two
    fixed = _config(make_config, 1, "resources.placement=auto")
    fixed.resources.rollout_devices = 3 - p.ahead.n_devices  # the user's split is kept
    assert plan_for_config(fixed).ahead.n_devices == 3 - p.ahead.n_devices
    # resources.frozen_pool=both under auto asks the planner for both (the reference on both sides)
    both = _config(make_config, 1, "resources.placement=auto")
    both.resources.frozen_pool = "both"
    planned = plan_for_config(both)
    assert planned.ahead.frozen_pool == "both" and planned.ahead.frozen == ["reference"]
    assert placement_from_plan(planned, both).ref_on_training


def test_a_plan_priced_with_full_rollout_weights_gets_a_note(make_config):
    """The trainer's rollout ranks hold and receive only their shards (rollout/pool_tp.py): a tg > 1 plan
    priced with --rollout-full-weights says so, one priced as shards (the default) says nothing."""
    from hybridflow.planner import EngineLimits
    from hybridflow.trainers.plan_schedule import report_schedule

    lines: list[str] = []
    ahead = SimpleNamespace(tg=2, n_devices=2, iteration_seconds=1.0)
    for full, notes in ((True, 1), (False, 0)):
        p = SimpleNamespace(
            rollout_ahead=1,
            ahead=ahead,
            synchronous_seconds=2.0,
            limits=EngineLimits(rollout_full_weights=full),
        )
        lines.clear()
        report_schedule(p, _config(make_config, 1), SimpleNamespace(print=lines.append))
        assert sum("rollout ranks hold and receive 1/2 of them" in x for x in lines) == notes, lines


def test_a_plan_with_the_reference_on_both_sides_places_it_twice(make_config, tiny_model_dir):
    """ahead.frozen_pool: both (planner/ahead_both.py): the reference on the rollout pool, data parallel
    there, and in the actor's workers (Placement.ref_on_training), as resources.frozen_pool=both does."""
    both = _plan(tiny_model_dir, 3, "ahead", "both")
    r = both.ahead
    assert r.frozen_pool == "both" and r.frozen == ["reference"] and 0 <= r.ref_rows_on_rollout <= 1
    assert both.model("reference").pool == both.model("actor").pool  # the training side's reference
    for want in ("auto", "both"):
        placement = placement_from_plan(both, _pinned(make_config, want))
        assert placement.ref_on_training and placement.pool_of("ref") == "rollout"
        assert placement.parallel["ref"] == RoleParallel(1, 1, r.n_devices)
    on_rollout = _plan(tiny_model_dir, 3, "ahead", "rollout")
    assert not placement_from_plan(on_rollout, _config(make_config, 1)).ref_on_training
    with pytest.raises(
        ConfigError, match=r"in the rollout pool but resources.frozen_pool=both; .*--frozen-pool both"
    ):
        placement_from_plan(on_rollout, _pinned(make_config, "both"))
    with pytest.raises(
        ConfigError,
        match=r"in both pools \(the reference's rows split\) but resources.frozen_pool=rollout; "
        r"set resources.frozen_pool=both",
    ):
        placement_from_plan(both, _pinned(make_config, "rollout"))


def _pinned(make_config, frozen_pool: str):
    cfg = _config(make_config, 1)
    cfg.resources.frozen_pool = frozen_pool  # set after loading, as trainer.rollout_ahead is (see above)
    return cfg
