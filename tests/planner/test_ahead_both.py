"""frozen_pool="both" in the one-step-ahead planner (hybridflow/planner/ahead_both.py, docs/planner.md): the
reference in both pools, a fraction f of each batch's rows scored on the rollout pool.

The toy device of test_ahead.py (10 ms per layer per forward / decode step, nothing else costs): GRPO, actor +
reference (2 layers each), 8 prompts x 1, prompt 4, response R tokens, 2 devices (1 rollout | 1 training):
generation 0.02 (R + 1) s; the reference's forward over the batch 0.02 s on either side; the training side
with the whole reference 0.02 (actor old log-probs) + 0.02 (reference) + 0.48 (update) = 0.52 s.

R = 24: generation 0.50 s. rollout: max(0.50 + 0.02, 0.50) = 0.52; training: max(0.50, 0.52) = 0.52;
both: f = (0.50 + 0.02 - 0.50) / 0.04 = 1/2, max(0.50 + 0.01, 0.50 + 0.01) = 0.51, the shortest.
"""

from __future__ import annotations

import pytest

from hybridflow.cli import main
from hybridflow.planner import ClusterSpec, Plan, WorkloadSpec, build_dataflow, plan, plan_to_resources
from hybridflow.planner.ahead import search_ahead, training_side
from hybridflow.planner.ahead_both import best_both_split, split_reference
from tests.planner.test_ahead import TOY, TOY_MODEL


def _toy(response_len: int):
    wl = WorkloadSpec(prompts=8, prompt_len=4, response_len=response_len, mini_batches=1, micro_batch_size=1,
                      inference_micro_batch_size=8)  # fmt: skip
    return build_dataflow("grpo", TOY_MODEL, reward_model=False), ClusterSpec(TOY, 2, 2), wl


def test_split_reference_by_hand():
    # the sides meet inside [0, 1]: rollout 2 + 1 f = training 1 + 3 (1 - f) at f = 1/2
    assert split_reference(2.0, 1.0, 1.0, 3.0) == (0.5, 2.5, 2.5)
    assert split_reference(0.50, 0.50, 0.02, 0.02) == pytest.approx((0.5, 0.51, 0.51))
    # the training side is longer even with every row on the rollout pool: all of them go there
    assert split_reference(1.0, 3.0, 1.0, 3.0) == (1.0, 2.0, 3.0)
    # the rollout side is longer even with none: the training side scores them all
    assert split_reference(5.0, 1.0, 2.0, 2.0) == (0.0, 5.0, 3.0)
    # a cheaper reference on one side takes more rows there: 1 + 1 f = 1 + 3 (1 - f) at f = 3/4
    assert split_reference(1.0, 1.0, 1.0, 3.0) == (0.75, 1.75, 1.75)
    assert split_reference(1.0, 2.0, 0.0, 0.0) == (0.0, 1.0, 2.0)  # no reference work: nothing to split


def test_best_both_split_on_hand_made_curves():
    # 4 devices; generation 1.8 s on any n, the reference 0.4 / n there; training 6 / m with the reference
    # 1.2 / m of it; sync 0.1 (the training side waits for all of it)
    rollout, training = (lambda n: (1.8, 0.4 / n)), (lambda m: (6.0 / m, 1.2 / m))
    # n = 1 (m = 3): 1.9 + 0.4 f = 1.7 + 0.4 (1 - f) at f = 1/4: 2.0, the best
    # n = 2 (m = 2): 1.9 + 0.2 f = 2.5 + 0.6 (1 - f) at f = 3/2 > 1: all rows there, max(2.1, 2.5) = 2.5
    # n = 3 (m = 1): 1.9 + 0.4/3 f vs 4.9 + 1.2 (1 - f): f = 1, 4.9
    cost, n, f = best_both_split(rollout, training, lambda n: 0.1, 4)
    assert n == 1 and f == pytest.approx(0.25) and cost == pytest.approx(2.0)
    # the training side does not fit on 1 device: n = 3 is not tried
    assert best_both_split(rollout, lambda m: None if m < 2 else training(m), lambda n: 0.1, 4)[1] == 1
    # 3 devices, the training side 1 s (0.5 the reference) on 2 only: 1.8 + 0.4 f vs 0.5 + 0.5 (1 - f): f = 0
    fits_on_two = lambda m: None if m < 2 else (1.0, 0.5)  # noqa: E731
    assert best_both_split(rollout, fits_on_two, lambda n: 0.0, 3) == (1.8, 1, 0.0)
    assert best_both_split(rollout, lambda m: None, lambda n: 0.0, 3) is None


def test_auto_takes_both_only_where_it_evens_the_sides():
    df, cluster, wl = _toy(24)
    both = search_ahead(df, cluster, wl, frozen_pool="both")
    assert both.frozen == ("reference",) and both.train.placement == (("actor", "reference"),)
    assert both.ref_rows_on_rollout == pytest.approx(0.5)
    assert both.ref_rollout_seconds == pytest.approx(0.02) and both.ref_training_seconds == pytest.approx(
        0.02
    )
    assert both.rollout_side_seconds == pytest.approx(0.51) and both.training_side_seconds == pytest.approx(
        0.51
    )
    assert both.iteration_time == pytest.approx(0.51)
    for place in ("rollout", "training"):
        assert search_ahead(df, cluster, wl, frozen_pool=place).iteration_time == pytest.approx(0.52)
    assert search_ahead(df, cluster, wl, frozen_pool="auto").frozen_pool == "both"
    # one side dominates: both can do no better than the whole reference on the other side (a tie, and
    # it would hold the reference twice), so auto does not take it
    for response_len, winner, f in ((1, "rollout", 1.0), (40, "training", 0.0)):
        df, cluster, wl = _toy(response_len)
        assert search_ahead(df, cluster, wl, frozen_pool="both").ref_rows_on_rollout == f
        assert search_ahead(df, cluster, wl, frozen_pool="auto").frozen_pool == winner


def test_both_needs_a_reference_and_keeps_the_others_on_the_rollout_pool():
    df, cluster, wl = _toy(24)
    reward_only = type(df)(
        df.algorithm, tuple(m for m in df.models if m.role != "reference"), df.old_log_probs
    )
    with pytest.raises(ValueError, match="frozen_pool both splits the reference's rows"):
        search_ahead(reward_only, cluster, wl, frozen_pool="both")
    assert search_ahead(reward_only, cluster, wl, frozen_pool="auto").frozen_pool != "both"
    ppo = build_dataflow("ppo", TOY_MODEL)
    assert training_side(ppo, "both").roles == ("actor", "critic", "reference")


def test_a_both_plan_round_trips_and_older_plans_load(tmp_path):
    df, cluster, wl = _toy(24)
    p = plan(df, cluster, wl, schedule="ahead", frozen_pool="auto")
    r = p.ahead
    assert p.rollout_ahead == 1 and r.frozen_pool == "both" and r.frozen == ["reference"]
    assert r.ref_rows_on_rollout == pytest.approx(0.5) and r.scoring_seconds == pytest.approx(0.01)
    assert r.training_side_seconds == pytest.approx(0.51) and p.iteration_seconds == pytest.approx(0.51)
    assert [m.role for m in p.models] == ["actor", "reference"]  # the training side's reference
    assert Plan.load(p.save(tmp_path / "plan.yaml")) == p
    assert plan_to_resources(p).pools == {"actor+reference": 1, "rollout": 1}
    old = p.to_dict()  # written before "both": no row share, no per-side reference seconds
    old["ahead"]["frozen_pool"] = "rollout"
    for key in ("ref_rows_on_rollout", "ref_rollout_seconds", "ref_training_seconds"):
        del old["ahead"][key]
    assert Plan.from_dict(old).ahead.ref_rows_on_rollout == 0.0
    old["ahead"]["frozen_pool"] = "driver"
    with pytest.raises(
        ValueError, match=r"ahead.frozen_pool must be one of \('rollout', 'training', 'both'\)"
    ):
        Plan.from_dict(old)


def test_explain_sets_the_frozen_pools_side_by_side(capsys):
    args = [
        "plan",
        "--model-size",
        "7B",
        "--gpus",
        "8",
        "--gpu",
        "a100-80",
        "--schedule",
        "ahead",
        "--explain",
    ]
    assert main([*args, "--frozen-pool", "both"]) == 0
    text = capsys.readouterr().out
    assert "where the frozen models run (--frozen-pool)" in text
    words = " ".join(text.split())  # the plan's own line, however the console wraps it
    assert "of the reference's rows, the rest on the training side)" in words
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.startswith("│ ")}
    assert "both <- plan" in rows and "rollout" in rows and "training" in rows
    share = rows["both <- plan"].split("│")[5].strip()
    assert share.endswith("%") and 0 <= int(share[:-1]) <= 100


@pytest.mark.parametrize(
    "flags, has_reward",
    [(["--algorithm", "grpo"], False), (["--algorithm", "grpo", "--reward-model"], True),
     (["--algorithm", "ppo"], True), (["--algorithm", "ppo", "--no-reward-model"], False)],
)  # fmt: skip
def test_grpo_plans_a_rule_reward_unless_told(tmp_path, flags, has_reward):
    """GRPO's default is a rule-based reward (no reward model to place), PPO's the paper's reward model;
    --reward-model / --no-reward-model say otherwise."""
    out = tmp_path / "plan.yaml"
    args = ["plan", "--model-size", "7B", "--gpus", "8", "--schedule", "sync", *flags, "--output", str(out)]
    assert main(args) == 0
    models = {m.role for m in Plan.load(out).models}
    assert ("reward" in models) == has_reward and "actor" in models, models
