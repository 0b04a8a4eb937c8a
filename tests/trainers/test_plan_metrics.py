"""trainers/plan_metrics.py: a plan's predicted stage seconds beside the measured stage wall times, on
hand-made timelines (the run that logs them: test_auto_placement.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridflow.trainers.plan_metrics import plan_metrics


def _times(**spans) -> dict[str, float]:
    out = {}
    for phase, (start, end) in spans.items():
        out[f"timing_s/timeline/{phase}/start"], out[f"timing_s/timeline/{phase}/end"] = start, end
    return out


def test_stages_are_the_wall_time_of_their_phases():
    plan = SimpleNamespace(
        stage_seconds={"generation": 1.0, "preparation": 0.5, "training": 2.0}, iteration_seconds=3.6,
        rest_seconds=0.1, rollout_ahead=0,
    )  # fmt: skip
    # generation 0..1.2; values 1.3..1.9 and ref 1.25..1.6 ran at once (split pools); adv 1.9..2.0 is not
    # a priced stage; the critic's update 2.0..3.0 and the actor's 2.0..3.5 ran at once
    times = _times(gen=(0.0, 1.2), values=(1.3, 1.9), ref=(1.25, 1.6), adv=(1.9, 2.0),
                   update_critic=(2.0, 3.0), update_actor=(2.0, 3.5))  # fmt: skip
    out = plan_metrics(plan, times)
    assert out["plan/predicted_s/generation"] == 1.0 and out["plan/predicted_s/iteration"] == 3.6
    assert out["plan/predicted_s/rest"] == 0.1  # the advantages' call, logged beside the stages
    assert out["timing_s/stage/generation"] == pytest.approx(1.2)
    assert out["timing_s/stage/preparation"] == pytest.approx(1.9 - 1.25)
    assert out["timing_s/stage/training"] == pytest.approx(1.5)
    # one step ahead the step's gen phase is the wait for the rollout pool, not the generation priced
    ahead = plan_metrics(SimpleNamespace(**{**vars(plan), "rollout_ahead": 1}), times)
    assert "timing_s/stage/generation" not in ahead and "plan/predicted_s/generation" in ahead
    # a stage none of whose phases ran is not reported as 0
    assert "timing_s/stage/training" not in plan_metrics(plan, _times(gen=(0.0, 1.0)))


def test_a_phase_that_did_no_work_does_not_start_its_stage():
    """PPO with the old log-probs from the update (the no-op driver phase at 24.7 ms): preparation runs from
    the values' start, when their call reached the critic, to their end, as the plan prices it (its call
    is in the rest)."""
    plan = SimpleNamespace(
        stage_seconds={"generation": 0.02, "preparation": 0.03, "training": 0.08}, iteration_seconds=0.17,
        rest_seconds=0.04, rollout_ahead=0,
    )  # fmt: skip
    times = _times(gen=(0.0, 0.0196), old_log_prob=(0.0247, 0.0248), values=(0.0311, 0.0767))
    assert plan_metrics(plan, times)["timing_s/stage/preparation"] == pytest.approx(0.0767 - 0.0311)
    assert "timing_s/stage/preparation" not in plan_metrics(plan, _times(old_log_prob=(0.0247, 0.0248)))


def test_a_driver_phase_ends_its_stage_but_does_not_start_it():
    """A rule reward scored in the driver (27.8-30.6 ms) while the values' call travels to the critic (it
    starts there at 31.1 ms): the stage starts with the values, as the plan prices it (the call is in the
    rest); a reward that outlasts the values ends the stage; a stage of driver phases alone is their span."""
    plan = SimpleNamespace(
        stage_seconds={"generation": 0.02, "preparation": 0.03, "training": 0.08}, iteration_seconds=0.17,
        rest_seconds=0.04, rollout_ahead=0,
    )  # fmt: skip
    in_driver = frozenset({"old_log_prob", "reward"})
    times = _times(gen=(0.0, 0.0196), old_log_prob=(0.0247, 0.0248), reward=(0.0278, 0.0306),
                   values=(0.0311, 0.0767))  # fmt: skip
    assert plan_metrics(plan, times, in_driver)["timing_s/stage/preparation"] == pytest.approx(
        0.0767 - 0.0311
    )
    # counted as a worker's phase, the reward would start the stage 3.3 ms early
    assert plan_metrics(plan, times)["timing_s/stage/preparation"] == pytest.approx(0.0767 - 0.0278)
    times["timing_s/timeline/reward/end"] = 0.0800
    assert plan_metrics(plan, times, in_driver)["timing_s/stage/preparation"] == pytest.approx(
        0.0800 - 0.0311
    )
    alone = _times(old_log_prob=(0.0247, 0.0248), reward=(0.0278, 0.0306))  # GRPO without a reference
    assert plan_metrics(plan, alone, in_driver)["timing_s/stage/preparation"] == pytest.approx(
        0.0306 - 0.0278
    )
