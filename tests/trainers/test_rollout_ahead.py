"""trainer.rollout_ahead=1 through the trainer (real Ray groups, gloo): a rollout pool of its own samples
step k+1 while the actor trains on step k, the weights go over a gloo group spanning both pools, the loss
carries truncated importance weights, and a run resumed from a checkpoint repeats the uninterrupted one
(the batch in flight is in the checkpoint). Learning on the demo recipe: tests/trainers/test_learning.py.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from hybridflow.config import ConfigError
from hybridflow.controller import Future
from hybridflow.models import load_causal_lm
from hybridflow.trainers import build_trainer
from tests.trainers.lifecycle_helpers import assert_rollout_pool_greedy_equals_actor

DIGITS = f"reward.fn={Path(__file__).with_name('rewards.py')}:digit_reward"
AHEAD = (DIGITS, "trainer.rollout_ahead=1", "trainer.val_before_train=false")
LAG = "rollout/policy_lag"


def _comparable(row: dict) -> dict:
    return {
        k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/")) and not k.endswith("_time_s")
    }


def _param_bytes(model_dir) -> int:
    model = load_causal_lm(model_dir)
    return sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())


def test_six_steps_lag_one_and_resume_repeats_the_uninterrupted_run(ray_cluster, make_config, tiny_model_dir):
    settings = (*AHEAD, "trainer.total_steps=6", "trainer.save_every=3", "trainer.val_every=3")
    with build_trainer(make_config("grpo", *settings, "trainer.experiment_name=whole", devices=2)) as trainer:
        assert trainer.placement.pools == {"global": 1, "rollout": 1}
        assert trainer.groups["rollout"].world_size == 1 and trainer.cfg.actor.parallel.dp == 1
        whole = trainer.fit()
        # after a last sync the rollout pool samples exactly as the trained actor does
        assert_rollout_pool_greedy_equals_actor(trainer, 4)

    steps = [h for h in whole if h["step"] > 0]
    assert [h[LAG] for h in steps] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # steps 2-5 sync the whole model (tied embeddings once) over the gloo group spanning both pools before
    # issuing the next generation; step 1's rollout pool already holds model.path, step 6 has nothing to issue
    for h in (steps[0], steps[-1]):
        assert "sync/bytes" not in h and "timing_s/weight_sync" not in h
    assert {h["sync/bytes"] for h in steps[1:-1]} == {float(_param_bytes(tiny_model_dir))}
    assert all(h["timing_s/weight_sync"] > 0 for h in steps[1:-1])
    for h in steps:  # the loss carries the truncated importance weights, metrics pooled over the update
        assert 0 < h["actor/is_weight_mean"] <= 2.0 and 0 <= h["actor/is_weight_clipfrac"] <= 1
    assert abs(steps[0]["actor/is_weight_mean"] - 1) < 1e-5  # lag 0: sampled by the very same weights
    assert any(abs(h["actor/is_weight_mean"] - 1) > 1e-4 for h in steps[1:])  # lag 1: the policy moved

    cfg = make_config("grpo", *settings, "trainer.experiment_name=parts", "trainer.resume=auto", devices=2)
    with build_trainer(cfg) as trainer:
        first = trainer.fit(stop_after=3)
    ckpt = Path(cfg.run_dir) / "checkpoints" / "step_3"
    assert json.loads((ckpt / "rollout_ahead" / "state.json").read_text()) == {"step": 4, "version": 2}
    with build_trainer(cfg) as trainer:  # fresh worker processes; the batch in flight comes from step_3
        rest = trainer.fit()
    assert [h["step"] for h in first + rest] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(whole, first + rest, strict=True):
        assert _comparable(a) == _comparable(b), a["step"]


def test_with_learning_rate_zero_the_importance_weights_are_one(ray_cluster, make_config):
    cfg = make_config("grpo", *AHEAD, "actor.optim.lr=0", "trainer.total_steps=3", devices=2)
    with build_trainer(cfg) as trainer:
        steps = trainer.fit()
    assert [h[LAG] for h in steps] == [0.0, 1.0, 1.0]
    for h in steps:
        # the rollout's log-probs (its KV-cached decoder) and the actor's recompute (one full forward) agree to
        # float32 rounding: the same weights, so nothing is truncated and nothing is reweighted
        assert abs(h["actor/is_weight_mean"] - 1) < 1e-5, h["actor/is_weight_mean"]
        assert h["actor/is_weight_clipfrac"] == 0.0
        assert math.isfinite(h["actor/pg_loss"])
        # timing_s/gen is the wait for the batch made a step ahead, not generation: no FLOP/s from it
        assert "perf/tflops_per_device/gen" not in h and "perf/tflops_per_device/update_actor" in h


def test_the_actor_sends_without_waiting_for_the_rollout_pool(ray_cluster, make_config):
    """workers/weight_sync.py: actor rank 0 issues its broadcasts and returns (its next update need not
    wait); the rollout ranks receive them later, every byte, and then sample as the actor does."""
    with build_trainer(make_config("grpo", *AHEAD, "trainer.total_steps=3", devices=2)) as trainer:
        # the actor has moved one update; the rollout pool holds model.path and is idle (stopping wrote a
        # checkpoint, which waited for the batch it generated ahead)
        trainer.fit(stop_after=1)
        ahead = trainer.source
        assert ahead.rollout_version == 0 and not isinstance(ahead.in_flight.rollouts, Future)
        send = trainer.actor.send_weights.future(ahead._spec)
        deadline = time.time() + 120
        while not send.done() and time.time() < deadline:
            time.sleep(0.05)
        assert send.done(), "send_weights waited for a receiver that was never called"
        received = trainer.groups["rollout"].receive_weights(ahead._spec)
        sent = send.get()[0]["sync/bytes"]
        assert sent > 0 and [r["sync/bytes"] for r in received] == [sent]
        ahead.rollout_version = trainer.global_step  # what was sent: the actor after step 1
        assert_rollout_pool_greedy_equals_actor(trainer, 4)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("trainer.rollout_ahead=1",), "trainer.rollout_ahead: 1 needs at least 2 devices"),
        (("trainer.rollout_ahead=2",), "trainer.rollout_ahead: 2 is not one of [0, 1]"),
        (("resources.rollout_devices=1",), "resources.rollout_devices: 1 is only used with trainer.rollout_ahead=1"),
        (("trainer.rollout_ahead=1", "resources.n_gpus_per_node=2", "resources.rollout_devices=2"),
         "resources.rollout_devices: must leave training at least one of the 2 devices"),
        (("trainer.rollout_ahead=1", "resources.n_gpus_per_node=2", "resources.placement=split"),
         "resources.placement: split needs 2 training devices"),
        (("trainer.rollout_ahead=1", "resources.n_gpus_per_node=3", "resources.rollout_devices=2", "rollout.tg=3"),
         "rollout.tg: 3 must divide the rollout pool's 2 devices"),
        (("algorithm.name=sft", "trainer.rollout_ahead=1", "resources.n_gpus_per_node=2"),
         "trainer.rollout_ahead: sft trains on a fixed dataset"),
        (("trainer.rollout_ahead=1", "resources.n_gpus_per_node=3", "algorithm.use_kl_loss=true", "ref.parallel.tp=2"),
         "ref.parallel: tp*pp = 2 does not divide the 1 devices of its pool"),
    ],
)  # fmt: skip
def test_what_the_schedule_cannot_serve_is_one_line(make_config, overrides, message):
    with pytest.raises(ConfigError) as e:
        make_config("grpo", *overrides)
    assert any(line.startswith(message) for line in e.value.errors), e.value.errors


def test_the_devices_split_between_training_and_rollout(make_config):
    from hybridflow.trainers.placement import Placement

    cfg = make_config("ppo", "trainer.rollout_ahead=1", devices=5)
    assert Placement.from_config(cfg).pools == {"global": 3, "rollout": 2}  # 0 = half, rounded down
    assert cfg.actor.parallel.dp == cfg.critic.parallel.dp == 3
    cfg = make_config("ppo", "trainer.rollout_ahead=1", "resources.placement=split", "resources.rollout_devices=1",
                      devices=5)  # fmt: skip
    placement = Placement.from_config(cfg)
    assert placement.pools == {"actor": 2, "critic": 2, "rollout": 1}
    # the frozen models score on the rollout pool (resources.frozen_pool=rollout, the default): its dp there
    assert (
        placement.pool_of("rollout") == placement.pool_of("ref") == placement.pool_of("reward") == "rollout"
    )
    assert cfg.ref.parallel.dp == cfg.reward.parallel.dp == 1 and cfg.critic.parallel.dp == 2
    cfg = make_config("ppo", "trainer.rollout_ahead=1", "resources.placement=split", "resources.rollout_devices=1",
                      "resources.frozen_pool=training", "algorithm.use_kl_loss=true", devices=5)  # fmt: skip
    assert Placement.from_config(cfg).pool_of("ref") == "actor" and cfg.ref.parallel.dp == 2


def test_bf16_rollout_pool_holds_and_receives_bf16(ray_cluster, make_config, tiny_model_dir):
    """model.dtype=bfloat16: the rollout pool stores its weights in the actor's compute dtype, so each sync
    carries half the fp32 bytes, and the loss still reweights the one-step lag (finite weights near 1)."""
    cfg = make_config("grpo", *AHEAD, "model.dtype=bfloat16", "trainer.total_steps=3", devices=2)
    with build_trainer(cfg) as trainer:
        held = trainer.groups["rollout"].rollout_param_bytes()
        steps = trainer.fit()
    half = _param_bytes(tiny_model_dir) // 2
    assert held == [half]
    assert [h[LAG] for h in steps] == [0.0, 1.0, 1.0] and steps[1]["sync/bytes"] == float(half)
    for h in steps:
        assert math.isfinite(h["actor/pg_loss"]) and 0.5 < h["actor/is_weight_mean"] <= 2.0


def test_lora_actor_syncs_merged_weights_to_the_rollout_pool(ray_cluster, make_config, tiny_model_dir):
    """model.lora with rollout_ahead=1: the sync carries the actor's weights with the adapters merged (the
    pool's model is the plain HF model), every weight whole; the reference stays the actor's adapters off."""
    lora = ("model.lora.rank=4", "model.lora.alpha=32", "actor.optim.lr=1e-2", "algorithm.use_kl_loss=true")
    cfg = make_config(
        "grpo", *AHEAD, *lora, "trainer.total_steps=3", "trainer.experiment_name=lora", devices=2
    )
    with build_trainer(cfg) as trainer:
        assert "ref" not in trainer.source.frozen_roles  # no base model on the rollout pool
        steps = trainer.fit()
        assert_rollout_pool_greedy_equals_actor(trainer, 4)  # the pool's weights are the merged actor's
    assert [h[LAG] for h in steps] == [0.0, 1.0, 1.0]
    assert steps[1]["sync/bytes"] == float(_param_bytes(tiny_model_dir))
    assert steps[-1]["actor/kl_loss"] > 0  # the adapters moved the actor away from the reference (its base)
