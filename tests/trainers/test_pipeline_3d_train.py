"""`hybridflow train` with every model on 4 CPU ranks in two pipeline stages composed with tensor or data
parallelism: PPO with the actor, the critic, the reference (the KL loss) and a reward model all at
p = 2 x t = 2, then all at p = 2 x d = 2, the actor generating with tg = 1. Two steps equal the p = 1 run
on the same 4 ranks (d = 4): all three generate with 4 replicas of the whole model, so the rollouts match,
and so must the reward model's scores (each sequence's), the values, advantages and returns, and both
models' updates: losses, grad norms, and the updated actor's log-probs (step 2's old log-probs, as their
perplexity). Tolerances as tests/trainers/test_pipeline_roles.py states them: fp32 sums of at most a few
hundred terms, 1e-4 relative; means of ~0 quantities (log-ratios, the KL) 1e-6 absolute; a score (a dot
product of 64 terms, two tp partial sums) 1e-5. Greedy validation equals token for token, and the switch's
bytes and held weights equal cost.pipeline_switch_cost every step. (tg = 2, the generation TP group of a
stage, at worker level: tests/hybrid_engine/test_pipeline_reshard_workers.py.)
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.cli import main as cli_main
from hybridflow.models import load_reward_model, save_hf_model
from tests.trainers.lifecycle_helpers import grpo_config

STEPS = 2
SECTIONS = ("actor", "critic", "ref", "reward")
COMPARED = ("actor/", "critic/", "advantages/", "returns/", "values/", "reward/mean", "response_length/",
            "rollout_corr/training_ppl", "rollout/weight_update_bytes")  # fmt: skip
# name -> overrides (rollout.tg = 1); each pipelined run is compared with p1d4
RUNS = {
    "p2t2": [f"{s}.parallel.{k}=2" for s in SECTIONS for k in ("pp", "tp")],
    "p2d2": [f"{s}.parallel.pp=2" for s in SECTIONS],
    "p1d4": [],
}
PAIRS = (("p2t2", "p1d4"), ("p2d2", "p1d4"))


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_dir, tmp_path_factory):
    """{name: metrics rows}, and the runs' directory."""
    tmp = tmp_path_factory.mktemp("pipeline_3d")
    torch.manual_seed(3)  # the reward model's score head: random, so its scores vary between samples
    rm = save_hf_model(load_reward_model(tiny_model_dir), tmp / "rm")
    out = {}
    for name, overrides in RUNS.items():
        config = grpo_config(
            tmp,
            tiny_model_dir,
            data="num_samples: 16, val_size: 2",
            resources="n_gpus_per_node: 4",
            trainer=f"experiment_name: {name}, total_steps: {STEPS}, save_every: 0, loggers: [jsonl], "
            f"val_every: {STEPS}, validation_data_dir: '{tmp / name / 'val'}', "
            f"rollout_data_dir: '{tmp / name / 'gen'}'",
        )
        args = ["train", str(config), "algorithm.name=ppo", "algorithm.use_kl_loss=true", "reward.kind=model",
                f"model.reward_model_path={rm}", "actor.micro_batch_size_per_device=2",
                "critic.micro_batch_size_per_device=2", "critic.optim.lr=1e-2", "actor.optim.eps=1e-6",
                "critic.optim.eps=1e-6", *overrides]  # fmt: skip
        assert cli_main(args) == 0, name
        out[name] = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    out["dir"] = tmp
    return out


@pytest.mark.parametrize("got_name,want_name", PAIRS)
def test_pipelined_ppo_equals_p1(runs, got_name, want_name):
    got_rows, want_rows = ([r for r in runs[n] if r["step"] >= 1] for n in (got_name, want_name))
    assert len(got_rows) == len(want_rows) == STEPS
    named = {"actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/vf_loss", "critic/grad_norm",
             "critic/values_mean", "rollout_corr/training_ppl"}  # fmt: skip
    for got, want in zip(got_rows, want_rows):
        keys = [k for k in want if k.startswith(COMPARED)]
        assert named <= set(keys) <= set(got), named - set(keys)
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got_name, got["step"], key)
        assert got["actor/grad_norm"] > 0 and got["critic/grad_norm"] > 0
        assert got["reshard/bytes_per_rank"] == got["reshard/formula_bytes_per_rank"] > 0
        assert got["reshard/gen_weight_bytes_per_rank"] == got["reshard/formula_gen_weight_bytes_per_rank"]
    assert got_rows[-1]["actor/kl_loss"] > 1e-6  # the second step's KL reads a reference the actor has left


@pytest.mark.parametrize("got_name,want_name", PAIRS)
def test_samples_and_reward_model_scores_equal_per_sequence(runs, got_name, want_name):
    """Each training sample, and each greedy validation sample before and after the updates, equals
    p = 1's token for token; its score from the reward model in two stages (the last stage's head reads
    the sequence's last attended token; at t = 2 the tp group's all-reduced hidden states) equals p = 1's."""
    for kind, steps, rows in (("gen", range(1, STEPS + 1), 8), ("val", (0, STEPS), 2)):
        for step in steps:
            got, want = (
                [json.loads(x) for x in (runs["dir"] / n / kind / f"{step}.jsonl").read_text().splitlines()]
                for n in (got_name, want_name)
            )
            assert [r["output"] for r in got] == [r["output"] for r in want] and len(got) == rows
            assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], rel=1e-5, abs=1e-6)
            assert len({round(r["score"], 4) for r in want}) > 1  # varied: the head reads each sequence
