"""The one-step-ahead schedule in the planner (hybridflow/planner/ahead.py, docs/planner.md).

Hand-computed cases on a toy device whose only costs are 10 ms per layer per forward / decode step
(infinite FLOP/s and bandwidths, no latency), so every stage is a count of layer passes:
GRPO, actor + reference (2 layers each), 8 prompts x 1, prompt 4 tokens, response R tokens,
one mini-batch, training micro-batch 1, inference micro-batch 8, 2 devices.

- generation on any number of devices: prefill 2 x 10 ms + R decode steps x 2 x 10 ms = 0.02 (R + 1);
- a forward over the batch (actor's old log-probs, reference): 2 layers x 10 ms = 0.02 s each;
- training on d devices: ceil(8 / d) micro-batches x 2 layers x 3 passes x 10 ms = 0.06 ceil(8 / d).

Synchronous (best: colocate on 2): 0.02 (R + 1) + 0.04 + 0.24. One step ahead: rollout pool 1 device,
actor + reference on the other: max(0.02 (R + 1), 0.04 + 0.48) + sync 0.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hybridflow.cli import main
from hybridflow.planner import (
    ClusterSpec,
    ModelSpec,
    Plan,
    WorkloadSpec,
    build_dataflow,
    plan,
    plan_to_resources,
)
from hybridflow.planner.ahead import (
    ahead_iteration_seconds,
    best_split,
    rollout_option,
    search_ahead,
    sender_wait_fraction,
    training_side,
    weight_sync_bytes,
    weight_sync_seconds,
)
from hybridflow.planner.specs import DEVICES, EngineLimits

TOY = replace(
    DEVICES["cpu"], name="toy", peak_flops=math.inf, hbm_bandwidth=math.inf, intra_node_bandwidth=math.inf,
    inter_node_bandwidth=math.inf, host_bandwidth=math.inf, comm_latency_s=0.0, layer_overhead_s=0.01,
    decode_step_overhead_s=0.0,
)  # fmt: skip
TOY_MODEL = ModelSpec("toy", 2, 64, 2, 2, 128, 100)  # 94,720 parameters


def _toy_plan(response_len: int, schedule: str = "auto") -> Plan:
    wl = WorkloadSpec(
        prompts=8, prompt_len=4, response_len=response_len, mini_batches=1, micro_batch_size=1,
        inference_micro_batch_size=8,
    )  # fmt: skip
    return plan(
        build_dataflow("grpo", TOY_MODEL, reward_model=False), ClusterSpec(TOY, 2, 2), wl, schedule=schedule
    )


def test_iteration_is_the_longer_side_plus_the_weight_sync():
    assert ahead_iteration_seconds(3.0, 5.0, 0.5) == 5.5
    assert ahead_iteration_seconds(5.0, 3.0, 0.5) == 5.5
    # the actor's rank 0 leaves its broadcasts in flight: only the rollout side waits for the sync
    assert ahead_iteration_seconds(3.0, 5.0, 0.5, sender_waits=0.0) == 5.0
    assert ahead_iteration_seconds(4.8, 5.0, 0.5, sender_waits=0.0) == 5.3
    assert ahead_iteration_seconds(3.0, 5.0, 0.5, sender_waits=0.5) == 5.25


def test_sender_waits_for_what_exceeds_the_in_flight_bound():
    """workers/weight_sync.py keeps at most 1 GiB of packed buckets in flight behind the update."""
    actor = build_dataflow("grpo", TOY_MODEL).model("actor")  # 94,720 parameters
    weighing = lambda total: ClusterSpec(replace(TOY, bytes_per_param=total / 94_720), 2, 2)  # noqa: E731
    assert sender_wait_fraction(actor, weighing(50e6)) == 0.0  # 50 MB: all of it in flight
    assert sender_wait_fraction(actor, weighing(2**31)) == pytest.approx(0.5)  # 2 GiB: waits for half
    assert sender_wait_fraction(actor, weighing(14 * 2**30)) == pytest.approx(1 - 1 / 14)  # 7B in bf16


def test_best_split_on_hand_made_curves():
    # generation does not scale with devices (weight reads per replica), training does
    gen, train, sync = (lambda n: 4.0), (lambda m, limit: 12.0 / m), (lambda n: 0.25)
    assert best_split(gen, train, sync, 4) == (4.25, 1)  # n=1: max(4, 4) + 0.25
    # both scale linearly: the best split (2 | 2) is 6/2 + 0.5 = 3.5, worse than in turn on all
    # four devices, 6/4 + 6/4 = 3.0: with perfect scaling, overlap never pays for the split and sync
    lin = lambda n: 6.0 / n  # noqa: E731
    assert best_split(lin, lambda m, limit: lin(m), lambda n: 0.5, 4) == (3.5, 2)
    # nothing fits the training side with 1 device: only splits leaving it 2+
    assert best_split(gen, lambda m, limit: None if m < 2 else 1.0, sync, 3) == (4.25, 1)
    assert best_split(gen, lambda m, limit: None, sync, 3) is None
    # the training side is asked only for what could still beat the best split found
    limits = []
    best_split(lin, lambda m, limit: limits.append(limit) or lin(m), lambda n: 0.5, 4)
    assert limits == [math.inf, 6.5 - 0.5, 3.5 - 0.5]


def test_ahead_wins_when_generation_matches_training():
    """R = 25: generation 0.52 s (does not speed up with devices) = the training side 0.04 + 0.48 s."""
    p = _toy_plan(25)
    assert p.synchronous_seconds == pytest.approx(0.52 + 0.04 + 0.24)  # 0.80
    assert p.rollout_ahead == 1
    assert p.iteration_seconds == pytest.approx(0.52)  # 0.65x the synchronous iteration
    r = p.ahead
    assert (r.n_devices, r.first_device, r.pg, r.tg) == (1, 1, 1, 1)
    assert r.generation_seconds == pytest.approx(0.52) and r.training_side_seconds == pytest.approx(0.52)
    assert r.sync_seconds == 0.0 and r.sync_bytes == 94_720 * 4  # fp32 weights, one rollout device
    assert r.placement == [["actor", "reference"]] and r.allocation == [1]
    # the training side: the actor no longer generates, and holds no KV cache
    assert p.stage_seconds == pytest.approx({"generation": 0.52, "preparation": 0.04, "training": 0.48})
    assert p.model("actor").stage_seconds["generation"] == 0.0 and p.model("actor").n_devices == 1
    assert sum(pool.n_devices for pool in p.pools) + r.n_devices == 2


def test_ahead_loses_when_training_dominates_and_the_split_halves_it():
    """R = 1: generation 0.04 s; training alone on 1 device (0.48 s) costs more than all of
    generation + preparation + training on 2 (0.32 s)."""
    p = _toy_plan(1)
    assert p.rollout_ahead == 0
    assert p.iteration_seconds == pytest.approx(0.04 + 0.04 + 0.24)
    # recorded for --explain: the reference on the rollout pool hides its forward behind training (0.02 + 0.48)
    assert p.ahead.iteration_seconds == pytest.approx(0.50) and p.ahead.frozen == ["reference"]
    assert p.strategy == "colocate" and p.model("actor").stage_seconds["generation"] == pytest.approx(0.04)
    forced = _toy_plan(1, schedule="ahead")  # asked for, it is planned anyway
    assert forced.rollout_ahead == 1 and forced.iteration_seconds == pytest.approx(0.50)
    assert _toy_plan(25, schedule="sync").rollout_ahead == 0 and _toy_plan(25, schedule="sync").ahead is None


def test_frozen_models_are_priced_where_they_run():
    """R = 25: on the rollout pool the reference's forward (0.02 s) follows generation (0.52 s) and leaves
    the training side the actor's 0.02 + 0.48 s: max(0.54, 0.50) > max(0.52, 0.52) with it in the training
    pool, so `auto` keeps it there; at R = 1 (above) it goes to the rollout pool."""
    wl = WorkloadSpec(prompts=8, prompt_len=4, response_len=25, mini_batches=1, micro_batch_size=1,
                      inference_micro_batch_size=8)  # fmt: skip
    df, cluster = build_dataflow("grpo", TOY_MODEL, reward_model=False), ClusterSpec(TOY, 2, 2)
    on_rollout = search_ahead(df, cluster, wl, frozen_pool="rollout")
    assert on_rollout.frozen == ("reference",) and on_rollout.scoring_seconds == pytest.approx(0.02)
    assert on_rollout.train.placement == (("actor",),) and on_rollout.train.iteration_time == pytest.approx(
        0.50
    )
    assert on_rollout.iteration_time == pytest.approx(0.54)
    in_training = search_ahead(df, cluster, wl, frozen_pool="training")
    assert in_training.frozen == () and in_training.iteration_time == pytest.approx(0.52)
    assert search_ahead(df, cluster, wl, frozen_pool="auto").frozen_pool == "training"
    p = plan(df, cluster, wl, schedule="ahead", frozen_pool="rollout")
    assert p.ahead.frozen == ["reference"] and p.ahead.frozen_pool == "rollout"
    assert [m.role for m in p.models] == ["actor"] and p.iteration_seconds == pytest.approx(0.54)


def test_weight_sync_by_hand():
    dev = replace(TOY, bytes_per_param=1, comm_efficiency=1.0, comm_latency_s=0.01)
    actor = build_dataflow("grpo", TOY_MODEL).model("actor")
    w = 94_720.0  # bytes: 1 byte per parameter
    one_node = ClusterSpec(replace(dev, intra_node_bandwidth=w), 4, 4)
    # tg = 2: each rollout device gets half the weights at w B/s; 2 devices + the sender: 2 tree hops
    assert weight_sync_seconds(actor, one_node, 2, 1, 2) == pytest.approx(0.5 + 2 * 0.01)
    two_nodes = ClusterSpec(replace(dev, intra_node_bandwidth=w, inter_node_bandwidth=w / 2), 8, 4)
    # across nodes each rollout node takes the whole model through its NIC (w / 2 B/s): 2 s > 1 s inside
    assert weight_sync_seconds(actor, two_nodes, 4, 1, 1) == pytest.approx(2.0 + 3 * 0.01)


def test_rollout_pool_layout_fits_memory_with_waves():
    """The rollout pool holds only generation weights and the KV cache: too small a device makes it
    generate in waves, then not at all."""
    actor = build_dataflow("grpo", TOY_MODEL).model("actor")
    wl = WorkloadSpec(prompts=8, prompt_len=4, response_len=28)
    kv_per_seq = 2 * 2 * 2 * 32 * 4 * 32  # K and V x layers x kv heads x head dim x fp32 x 32 tokens
    weights = 94_720 * 4
    roomy = ClusterSpec(TOY, 2, 2)
    assert rollout_option(actor, roomy, wl, 1).waves == 1
    tight = ClusterSpec(replace(TOY, memory_bytes=(weights + 4 * kv_per_seq) / 0.9), 2, 2)
    opt = rollout_option(actor, tight, wl, 1)
    assert opt.waves == 2 and opt.kv_bytes == 4 * kv_per_seq
    assert opt.generation_seconds == pytest.approx(2 * 0.02 * 29)  # each wave re-runs prefill + decode
    assert rollout_option(actor, ClusterSpec(replace(TOY, memory_bytes=weights), 2, 2), wl, 1) is None


def test_rollout_ranks_holding_full_weights_are_priced_whole():
    """EngineLimits.rollout_full_weights (an engine whose rollout ranks slice the full weights themselves;
    the built-in trainer's hold and receive their shards, the default): a rank holds and is sent the whole
    model whatever tg. Two devices with room for half the weights plus the KV
    of all 8 sequences split over tg = 2: tg = 2 in one wave fits when ranks hold halves; holding the
    whole model, nothing fits (the model alone is over the budget)."""
    actor = build_dataflow("grpo", TOY_MODEL).model("actor")
    wl = WorkloadSpec(prompts=8, prompt_len=4, response_len=28)
    weights = 94_720 * 4
    kv_per_seq = 2 * 2 * 2 * 32 * 4 * 32  # K and V x layers x kv heads x head dim x fp32 x 32 tokens
    room = weights / 2 + 8 * kv_per_seq / 2 + 1  # per device, for tg = 2 in one wave
    cluster = ClusterSpec(replace(TOY, memory_bytes=room / 0.9), 2, 2)
    no_pg = EngineLimits(max_pg=1)
    whole = replace(no_pg, rollout_full_weights=True)
    halves = rollout_option(actor, cluster, wl, 2, no_pg)
    assert (halves.tg, halves.waves, halves.weight_bytes) == (2, 1, weights / 2)
    assert rollout_option(actor, cluster, wl, 2, whole) is None
    roomy = rollout_option(actor, ClusterSpec(TOY, 2, 2), wl, 2, replace(whole, max_rollout_tg=None))
    assert roomy.weight_bytes == weights
    assert weight_sync_bytes(actor, cluster, 1, 2) == weights / 2
    df = build_dataflow("grpo", TOY_MODEL, reward_model=False)
    assert search_ahead(df, ClusterSpec(TOY, 3, 3), wl, whole).sync_bytes == weights
    assert "rollout ranks hold full weights" in whole.describe()


def test_training_side_drops_only_generation():
    df = build_dataflow("remax", TOY_MODEL, samples_per_prompt=4)
    side = training_side(df)
    assert side.roles == df.roles
    assert side.model("actor").work == (("preparation", "infer"), ("training", "train"))
    assert side.model("reference") == df.model("reference")
    assert search_ahead(df, ClusterSpec(TOY, 1, 1), WorkloadSpec(prompts=8)) is None  # needs 2 devices


def test_ahead_plan_round_trips_and_names_the_rollout_pool(tmp_path):
    p = _toy_plan(25)
    loaded = Plan.load(p.save(tmp_path / "plan.yaml"))
    assert loaded == p
    res = plan_to_resources(loaded)
    assert res.rollout_ahead == 1 and res.pools == {"actor+reference": 1, "rollout": 1}
    assert res.models["rollout"].pool == "rollout" and res.models["rollout"].tg == 1


def test_plan_command_explains_both_schedules(capsys):
    """13B PPO on 32 A100s (the paper's workload): one step ahead is predicted faster; --schedule sync
    keeps the paper's colocate plan, whose --explain still shows the other schedule."""
    args = ["plan", "--model-size", "13B", "--gpus", "32", "--gpu", "a100-80", "--explain"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "rollout pool one step ahead" in text and "one step ahead wins" in text
    assert "synchronous (rollout_ahead=0)" in text and "one step ahead (rollout_ahead=1) <- plan" in text
    assert main([*args, "--schedule", "sync"]) == 0
    text = capsys.readouterr().out
    assert "colocate, predicted" in text and "synchronous (rollout_ahead=0) <- plan" in text
    assert "one step ahead (rollout_ahead=1)" not in text  # sync: the other schedule is not searched
