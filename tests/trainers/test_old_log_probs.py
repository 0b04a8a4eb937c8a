"""Old log-probs taken from the update's own forward when the update is one optimizer step
(trainers/sources/base.py old_log_prob_source): the same run as with a separate actor forward, without that forward.

Real Ray groups on the tiny model. The actor worker counts its compute_log_prob calls
(tests/trainers/tripwire_workers.py CountingActor); "forced" runs replace the rule by "actor" (the
separate forward every step), the only way to get the reference run, since no setting asks for it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridflow.trainers import build_trainer, placement
from hybridflow.trainers.sources import OldLogProbs, base, old_log_prob_source
from hybridflow.workers import ActorRolloutRefWorker
from tests.trainers.tripwire_workers import CountingActor

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
AHEAD = (DIGITS, "trainer.rollout_ahead=1", "trainer.val_before_train=false")


def _fit(cfg, forced: bool) -> tuple[list[dict], int]:
    """The run's metrics and how many separate old-log-prob forwards the actor ran (per rank)."""
    spec = placement._spec

    def counting(cfg, role, kwargs, with_ref):
        cls, kw = spec(cfg, role, kwargs, with_ref)
        return (CountingActor if cls is ActorRolloutRefWorker else cls), kw

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(placement, "_spec", counting)
        if forced:
            mp.setattr(
                base, "old_log_prob_source", lambda cfg, rollout_exact=True, on_policy=None: OldLogProbs.ACTOR
            )
        with build_trainer(cfg) as trainer:
            rows = trainer.fit()
            (calls, *others) = trainer.actor.count_log_prob_calls()
    assert all(c == calls for c in others)
    return [r for r in rows if r["step"] > 0], calls


def _assert_same_run(skipped: list[dict], forced: list[dict]) -> None:
    assert len(skipped) == len(forced)
    for a, b in zip(skipped, forced, strict=True):
        keys = {k for k in a if not k.startswith(("timing_s/", "perf/")) and not k.endswith("_time_s")}
        assert keys == {
            k for k in b if not k.startswith(("timing_s/", "perf/")) and not k.endswith("_time_s")
        }
        for k in keys:
            # ppo_kl / clipfrac: exactly 0 from the forward's own log-probs, float rounding of a second one;
            # the rollout gap's training side is the update's forward vs the separate one: the same up to that
            # rounding too (ppo_kl's 1e-6 bounds it; bf16 logits round to ~1e-5 of log-probs of size ~3)
            tol = 1e-6 if "ppo_kl" in k else 3e-5 if k.startswith("rollout/") else 1e-9
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=tol), (a["step"], k)
        # the ratio is exactly 1 where the gradient is taken: nothing clipped, no KL to the old policy
        assert a["actor/ppo_kl"] == 0.0 and a["actor/pg_clipfrac"] == 0.0
        # (no separate forward ran: the callers count the actor's calls; a timing bound would depend on load)


def test_rollout_ahead_takes_old_log_probs_from_the_update(ray_cluster, make_config):
    cfg = make_config("grpo", *AHEAD, devices=2)  # 2 steps: lag 0, then lag 1
    assert old_log_prob_source(cfg) == "update"
    skipped, calls = _fit(cfg, forced=False)
    assert calls == 0
    forced, calls = _fit(cfg, forced=True)
    assert calls == 2
    _assert_same_run(skipped, forced)
    assert [r["rollout/policy_lag"] for r in skipped] == [0.0, 1.0]
    # the gap at lag 0 is fp32 rounding only (tests/trainers/test_rollout_gap_runs.py); at lag 1 it holds the
    # policy's move over one update as well (docs/metrics.md): lr 1e-3 moves it far more than rounding
    gap = [r["rollout/log_prob_diff_mean"] for r in skipped]
    assert gap[0] < 1e-4 < gap[1], gap
    # importance weights are min(exp(logp - behaviour), cap) of the forward's own log-probs: 1 at lag 0
    assert abs(skipped[0]["actor/is_weight_mean"] - 1) < 1e-5
    assert abs(skipped[1]["actor/is_weight_mean"] - 1) > 1e-4


def test_bf16_takes_old_log_probs_from_the_update(ray_cluster, make_config):
    cfg = make_config("grpo", DIGITS, "model.dtype=bfloat16", "trainer.val_before_train=false")
    assert old_log_prob_source(cfg) == "update"  # bf16: the rollout's log-probs cannot stand in
    skipped, calls = _fit(cfg, forced=False)
    assert calls == 0
    forced, calls = _fit(cfg, forced=True)
    assert calls == 2
    _assert_same_run(skipped, forced)
    assert all(math.isfinite(r["actor/pg_loss"]) for r in skipped)


def test_two_mini_batches_keep_the_separate_forward(ray_cluster, make_config):
    cfg = make_config("grpo", DIGITS, "model.dtype=bfloat16", "actor.ppo_mini_batch_size=2",
                      "trainer.val_before_train=false", "trainer.total_steps=1")  # fmt: skip
    assert cfg.actor.num_mini_batches == 2 and old_log_prob_source(cfg) == "actor"
    rows, calls = _fit(cfg, forced=False)
    assert calls == 1 and len(rows) == 1
    # the second mini-batch is trained from weights the first one moved: a real ratio, a real KL
    assert all(r["actor/ppo_kl"] != 0.0 for r in rows)


@pytest.mark.parametrize(
    "overrides,exact,source",
    [
        ((), True, "rollout"),  # fp32, synchronous: the rollout's own log-probs
        ((), False, "update"),  # vLLM under top-k / top-p: they follow another convention
        (("model.dtype=bfloat16",), True, "update"),
        (("trainer.rollout_ahead=1",), True, "update"),
        (("trainer.rollout_ahead=1", "algorithm.kl.in_reward=true"), True, "actor"),  # read before the update
        (("model.dtype=bfloat16", "algorithm.kl.in_reward=true"), True, "actor"),
        (("algorithm.kl.in_reward=true",), True, "rollout"),
        (("actor.ppo_epochs=2",), True, "actor"),
        (("trainer.rollout_ahead=1", "actor.ppo_mini_batch_size=2"), True, "actor"),
    ],
)  # fmt: skip
def test_the_rule(make_config, overrides, exact, source):
    devices = 2 if "trainer.rollout_ahead=1" in overrides else 1
    for algorithm in ("grpo", "ppo", "rloo", "remax", "reinforce_pp"):
        cfg = make_config(algorithm, *overrides, devices=devices)
        assert old_log_prob_source(cfg, exact) == source, algorithm
