"""`hybridflow train` with the actor on 4 CPU ranks in two pipeline stages composed with tensor or data
parallelism: p = 2 x t = 2 and p = 2 x d = 2, both generating with tg = 1. GRPO for two steps equals the
p = 1 run on the same 4 ranks (d = 4): all three generate with 4 replicas of the whole model, so the
rollouts, rewards and advantages match and the updates must too: losses, grad norms, and the updated
actor's log-probs (step 2's old log-probs, as their perplexity). Tolerances as
tests/trainers/test_pipeline_train.py states them: fp32 sums of at most a few hundred terms, 1e-4
relative; log-ratio means (~1e-8 at ratio 1) 1e-6 absolute. Greedy validation equals token for token, and
the switch's bytes and held weights equal cost.pipeline_switch_cost every step. (tg = 2, the generation
TP group of a stage, at worker level: tests/hybrid_engine/test_pipeline_reshard_workers.py.)
"""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main as cli_main
from tests.trainers.lifecycle_helpers import grpo_config
from tests.trainers.test_pipeline_train import REWARD

STEPS = 2
COMPARED = ("actor/", "advantages/", "reward/mean", "response_length/", "rollout_corr/training_ppl",
            "rollout/weight_update_bytes")  # fmt: skip
# name -> overrides (rollout.tg = 1); each pipelined run is compared with p1d4
RUNS = {"p2t2": ["actor.parallel.pp=2", "actor.parallel.tp=2"], "p2d2": ["actor.parallel.pp=2"], "p1d4": []}
PAIRS = (("p2t2", "p1d4"), ("p2d2", "p1d4"))


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_dir, tmp_path_factory):
    """{name: metrics rows}, and the runs' directory."""
    tmp = tmp_path_factory.mktemp("pipeline_3d")
    (tmp / "varied.py").write_text(REWARD)
    out = {}
    for name, overrides in RUNS.items():
        config = grpo_config(
            tmp,
            tiny_model_dir,
            data="num_samples: 16, val_size: 2",
            resources="n_gpus_per_node: 4",
            trainer=f"experiment_name: {name}, total_steps: {STEPS}, save_every: 0, loggers: [jsonl], "
            f"val_every: {STEPS}, validation_data_dir: '{tmp / name / 'val'}'",
        )
        args = ["train", str(config), "actor.micro_batch_size_per_device=2",
                f"reward.fn={tmp / 'varied.py'}:varied", *overrides]  # fmt: skip
        assert cli_main(args) == 0, name
        out[name] = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    out["dir"] = tmp
    return out


@pytest.mark.parametrize("got_name,want_name", PAIRS)
def test_pipelined_grpo_equals_p1(runs, got_name, want_name):
    got_rows, want_rows = ([r for r in runs[n] if r["step"] >= 1] for n in (got_name, want_name))
    assert len(got_rows) == len(want_rows) == STEPS
    for got, want in zip(got_rows, want_rows):
        keys = [k for k in want if k.startswith(COMPARED)]
        assert {"actor/pg_loss", "actor/grad_norm", "rollout_corr/training_ppl"} <= set(keys) <= set(got)
        for key in keys:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got_name, got["step"], key)
        assert got["actor/grad_norm"] > 0
        assert got["reshard/bytes_per_rank"] == got["reshard/formula_bytes_per_rank"] > 0
        assert got["reshard/gen_weight_bytes_per_rank"] == got["reshard/formula_gen_weight_bytes_per_rank"]
    for step in (0, STEPS):  # greedy validation before and after the updates
        got, want = ((runs["dir"] / n / "val" / f"{step}.jsonl").read_text() for n in (got_name, want_name))
        assert got == want and got.count("\n") >= 2, step
