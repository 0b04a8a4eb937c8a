"""The planner prices the actor's old-log-prob forward only where the trainer runs one (dataflow.py,
trainers/sources/base.py old_log_prob_source): by hand on a toy model, through `hybridflow plan` and through
`resources.placement=auto`, and the planner's copy of the rule against the trainer's."""

from __future__ import annotations

import io
import itertools
import json

import pytest

from hybridflow.cli import main
from hybridflow.planner import ClusterSpec, ModelSpec, Plan, WorkloadSpec, build_dataflow, plan
from hybridflow.planner.ahead import training_side
from hybridflow.planner.dataflow import old_log_prob_work, with_old_log_probs
from hybridflow.trainers.auto_placement import (
    ENGINE_LIMITS,
    build_planner_cluster,
    build_planner_dataflow,
    build_planner_workload,
    plan_for_config,
)
from hybridflow.trainers.placement import placement_for_config
from hybridflow.trainers.plan_schedule import planner_old_log_probs
from hybridflow.trainers.sources import old_log_prob_source
from tests.trainers.configs import tiny_config

TOY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
TOY_CONFIG = dict(model_type="llama", intermediate_size=512, vocab_size=1000, **TOY)
# 4 prompts x 2 samples of 16 + 16 tokens: 8 sequences, one inference micro-batch of 8 on one device
WL = dict(prompts=4, samples_per_prompt=2, prompt_len=16, response_len=16)

# One forward over the batch on the catalogue's cpu device (p = t = d = 1), by hand (simulate.py):
#   layer params 2*256^2 + 2*256*256 + 3*256*512 = 655,360; per token at context 16:
#   2*(2*655,360 + 1000*256) + 4*2*256*16 = 3,166,208 FLOPs; 8 sequences x 32 tokens: 810,549,248 FLOPs
#   at 100 GFLOP/s x 0.3 efficiency x 256/(256 + 256) (GEMM width 256) = 15 GFLOP/s -> 0.054036616 s,
#   plus 2 layers x 1 ms of dispatch.
FORWARD_S = 810_549_248 / 15e9 + 2e-3


def _toy_dataflow(old_log_probs: str):
    spec = ModelSpec.from_config_dict(TOY_CONFIG)
    return build_dataflow("grpo", spec, reward_model=False, samples_per_prompt=2, old_log_probs=old_log_probs)


def test_preparation_prices_the_actor_forward_only_when_the_trainer_runs_it():
    """GRPO (actor + reference, rule reward) on one cpu device: preparation is the reference's forward,
    plus the actor's only with several optimizer steps."""
    cluster = ClusterSpec.build("cpu", 1)
    one_step = WorkloadSpec(**WL, mini_batches=1)
    two_epochs = WorkloadSpec(**WL, mini_batches=1, ppo_epochs=2)
    assert old_log_prob_work(1, 1) == "free" and old_log_prob_work(2, 1) == "actor"
    free = plan(_toy_dataflow("free"), cluster, one_step)
    actor = plan(_toy_dataflow("actor"), cluster, two_epochs)
    assert FORWARD_S == pytest.approx(0.056036617, rel=1e-8)
    assert free.model("actor").stage_seconds["preparation"] == 0.0
    assert free.model("reference").stage_seconds["preparation"] == pytest.approx(FORWARD_S, rel=1e-9)
    assert free.stage_seconds["preparation"] == pytest.approx(FORWARD_S, rel=1e-9)
    assert actor.model("actor").stage_seconds["preparation"] == pytest.approx(FORWARD_S, rel=1e-9)
    assert actor.stage_seconds["preparation"] == pytest.approx(2 * FORWARD_S, rel=1e-9)
    # the rest of the iteration does not depend on it: the same workload, only the forward differs
    same = plan(_toy_dataflow("actor"), cluster, one_step)
    assert same.iteration_seconds - free.iteration_seconds == pytest.approx(FORWARD_S, rel=1e-9)
    assert (free.old_log_probs, actor.old_log_probs) == ("free", "actor")


def test_one_step_ahead_prices_its_own_source():
    """KL in the reward on fp32 devices: synchronous takes the rollout's log-probs, one step ahead runs
    the actor forward (trainer.rollout_ahead=1); each schedule's training side prices its own."""
    assert old_log_prob_work(1, 1, kl_in_reward=True, fp32=True, rollout_ahead=0) == "free"
    assert old_log_prob_work(1, 1, kl_in_reward=True, fp32=True, rollout_ahead=1) == "actor"
    free = _toy_dataflow("free")
    assert training_side(free).model("actor").work == (("training", "train"),)
    assert training_side(with_old_log_probs(free, "actor")).model("actor").work == (
        ("preparation", "infer"),
        ("training", "train"),
    )
    cluster, wl = ClusterSpec.build("cpu", 2), WorkloadSpec(**WL, mini_batches=1)
    p = plan(free, cluster, wl, schedule="ahead", frozen_pool="training", ahead_old_log_probs="actor")
    assert (p.old_log_probs, p.ahead.old_log_probs, p.ahead.n_devices) == ("free", "actor", 1)
    # the training side's one device runs the actor's forward and the reference's, one after the other
    assert p.model("actor").stage_seconds["preparation"] == pytest.approx(FORWARD_S, rel=1e-9)
    assert p.stage_seconds["preparation"] == pytest.approx(2 * FORWARD_S, rel=1e-9)
    assert Plan.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="old_log_probs must be one of"):
        Plan.from_dict(dict(p.to_dict(), old_log_probs="update"))


def _cli_plan(tmp_path, capsys, *extra: str) -> tuple[Plan, str]:
    (tmp_path / "config.json").write_text(json.dumps(TOY_CONFIG))
    out = tmp_path / "plan.json"
    args = ["plan", "--model-config", str(tmp_path), "--gpu", "cpu", "--gpus", "1", "--algorithm", "grpo"]
    args += ["--no-reward-model", "--prompts", "4", "--samples-per-prompt", "2", "--prompt-len", "16"]
    args += ["--response-len", "16", "--explain", "--output", str(out), *extra]
    assert main(args) == 0
    return Plan.load(out), capsys.readouterr().out


def test_plan_command_derives_the_source_and_explains_it(tmp_path, capsys):
    one, text = _cli_plan(tmp_path, capsys, "--mini-batches", "1")
    assert one.stage_seconds["preparation"] == pytest.approx(FORWARD_S, rel=1e-9)
    assert (
        "old log-probs (as trainers/sources/base.py old_log_prob_source takes them): synchronous: the rollout's or "
        in text
    )
    two, text = _cli_plan(tmp_path, capsys, "--mini-batches", "1", "--ppo-epochs", "2")
    assert two.stage_seconds["preparation"] == pytest.approx(2 * FORWARD_S, rel=1e-9)
    assert "synchronous: a separate actor forward, priced in preparation" in text
    eight, _ = _cli_plan(tmp_path, capsys)  # the paper's 8 mini-batches: several steps
    assert eight.old_log_probs == "actor"
    kl, _ = _cli_plan(tmp_path, capsys, "--mini-batches", "1", "--kl-in-reward")
    assert kl.old_log_probs == "free"  # cpu computes in fp32: the synchronous rollout's own serve


def test_the_planner_rule_is_the_trainers(tiny_model_dir, tmp_path):
    """old_log_prob_work (what `hybridflow plan` derives) = trainers/sources/base.py old_log_prob_source on a real
    config, over every input the rule reads."""
    cfg = tiny_config(tiny_model_dir, tmp_path, "grpo")
    grid = itertools.product((1, 2), (1, 2), (False, True), ("float32", "bfloat16"), (0, 1), (False, True))
    for epochs, minis, kl, dtype, ahead, exact in grid:
        cfg.actor.ppo_epochs, cfg.actor.num_mini_batches, cfg.algorithm.kl.in_reward = epochs, minis, kl
        cfg.model.dtype, cfg.trainer.rollout_ahead = dtype, ahead
        trainer = old_log_prob_source(cfg, exact)
        planner = old_log_prob_work(epochs, minis, kl, dtype == "float32", ahead, exact)
        assert planner == ("actor" if trainer == "actor" else "free"), (
            epochs,
            minis,
            kl,
            dtype,
            ahead,
            exact,
        )


def test_auto_placement_asks_the_trainer(tiny_model_dir, tmp_path):
    """`resources.placement=auto` builds the dataflow from the run's config through old_log_prob_source."""
    one_step = tiny_config(tiny_model_dir, tmp_path, "grpo")  # 4 prompts, mini-batch 4, one epoch
    df = build_planner_dataflow(one_step)
    assert df.old_log_probs == "free" and df.model("actor").work == (
        ("generation", "generate"),
        ("training", "train"),
    )
    epochs = tiny_config(tiny_model_dir, tmp_path, "grpo", "actor.ppo_epochs=2")
    assert build_planner_dataflow(epochs).old_log_probs == "actor"
    assert build_planner_dataflow(epochs).model("actor").work[1] == ("preparation", "infer")
    # KL in the reward on CPU (fp32): the synchronous rollout's own log-probs; one step ahead: the actor's
    kl = tiny_config(tiny_model_dir, tmp_path, "grpo", "algorithm.kl.in_reward=true", devices=4)
    assert (planner_old_log_probs(kl), planner_old_log_probs(kl, 1)) == ("free", "actor")
    p = plan_for_config(kl)
    assert (p.rollout_ahead, p.old_log_probs, p.ahead.old_log_probs) == (0, "free", "actor")
    kl.rollout.engine, kl.rollout.top_p = "vllm", 0.9  # vLLM's truncated log-probs cannot stand in
    assert planner_old_log_probs(kl) == "actor"


def test_a_plan_file_priced_otherwise_gets_a_note(tiny_model_dir, tmp_path):
    """A plan made with the actor forward, run by a one-step config: the run says its times are off."""
    cfg = tiny_config(tiny_model_dir, tmp_path / "runs", "grpo", devices=2)
    inputs = build_planner_cluster(cfg), build_planner_workload(cfg)
    priced = plan(with_old_log_probs(build_planner_dataflow(cfg), "actor"), *inputs, limits=ENGINE_LIMITS)
    path = priced.save(tmp_path / "plan.yaml")
    planned = tiny_config(tiny_model_dir, tmp_path / "runs", "grpo", f"resources.placement={path}", devices=2)
    out = io.StringIO()
    placement_for_config(planned, out)
    text = " ".join(out.getvalue().split())  # rich wraps long lines
    assert "note: the plan prices an actor forward for old log-probs, but this run does not" in text
    auto = tiny_config(tiny_model_dir, tmp_path / "runs", "grpo", "resources.placement=auto", devices=2)
    out = io.StringIO()
    placement_for_config(auto, out)
    text = " ".join(out.getvalue().split())  # rich wraps long lines
    assert (
        "old log-probs (as trainers/sources/base.py old_log_prob_source takes them): both schedules: the rollout's"
        in text
    )
    assert "note: the plan prices" not in text
