"""A plan's predictions beside what the run measured, per step (runs with resources.placement=auto or a plan file).

The planner prices an iteration as three stages one after another (planner/dataflow.py STAGES); the trainer
times phases (controller/timers.py Timers). A stage's measured seconds are the wall time of its phases'
busy intervals (the earliest start to the latest end of `STAGE_PHASES[stage]`, from timing_s/timeline/),
which is what the plan's stage time predicts: the models of one pool take turns, pools run at once. A phase
that did no work (under MIN_PHASE_SECONDS: the old log-probs taken from the update) does not start its stage.

    plan/predicted_s/<stage>    the plan's seconds for generation / preparation / training
    plan/predicted_s/rest       the step's work no stage holds (the calls, the driver's); in the iteration
    plan/predicted_s/iteration  the plan's iteration seconds; measured: timing_s/step
    timing_s/stage/<stage>      the measured wall seconds of the stage's phases

The difference between timing_s/step and the sum of the stages is the rest: a stage's busy interval starts
when its workers start and ends when they end, so each stage's call (the driver's round trip to its workers
and back, the batch's transfer), the advantage computation (`adv`, a call on the actor's rank 0 between
preparation and training) and the driver's own work between phases (issuing and collecting the calls) fall
there; the plan prices them as `rest_seconds` (planner/simulate.py step_rest_time). A phase run in the driver
(a rule reward) can end its stage but not start it: the driver scores the responses as soon as it has issued
the preparation's calls, a few milliseconds before those calls reach their workers, and counting its start
would put that part of the calls' round trip, which the plan prices in the rest, inside the stage. One step ahead (plan rollout_ahead: 1) generation runs
on its own pool during the step, and the step's `gen` phase is the wait for it, so that stage's measured
figure is not logged.
"""

from __future__ import annotations

from hybridflow.planner.dataflow import STAGE_PHASES, stage_seconds


def plan_metrics(plan, times: dict[str, float], in_driver: frozenset[str] = frozenset()) -> dict[str, float]:
    """plan/predicted_s/* from `plan` (a planner Plan) and timing_s/stage/* from a step's `times`, whose
    phases `in_driver` ran in the driver (controller/timers.py Timers.driver_phases)."""
    out = {f"plan/predicted_s/{stage}": float(s) for stage, s in plan.stage_seconds.items()}
    out["plan/predicted_s/rest"] = float(plan.rest_seconds)
    out["plan/predicted_s/iteration"] = float(plan.iteration_seconds)
    for stage, phases in STAGE_PHASES.items():
        if stage == "generation" and plan.rollout_ahead:
            continue
        measured = stage_seconds(times, phases, in_driver)
        if measured is not None:
            out[f"timing_s/stage/{stage}"] = measured
    return out
