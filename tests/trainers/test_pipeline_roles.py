"""`hybridflow train` with every model in two pipeline stages: PPO with the actor, the critic, the
reference (the KL loss) and a reward model at parallel.pp = 2 on two CPU ranks, colocated, for two
steps, equals the same run with pp = 1 (FSDP over dp = 2) on the same ranks.

Both runs generate the same rollouts (tests/trainers/test_pipeline_train.py says why), so the reward
model's scores, the values, advantages and returns, and the per-step updates must match: fp32, sums
over at most a few hundred terms, summation order apart: 1e-4 relative bounds the update metrics with
room, 1e-5 each sequence's score (a dot product of 64 terms); means of ~0 quantities (log-ratios, the
KL to a reference the actor has barely left) get 1e-6 absolute, fp32 noise of log-probs of magnitude ~5.
AdamW's eps is 1e-6 here, so no gradient of noise size is normalised into a whole lr-sized step.
The critic's checkpoints across p: tests/engines/test_pipeline.py (the actor's: test_pipeline_train.py).
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
# the updates of both trained models and what fed them: the reward model's scores, the reference's KL,
# the critic's values (GAE's advantages and returns)
COMPARED = ("actor/", "critic/", "advantages/", "returns/", "values/", "reward/mean", "response_length/")


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_model_dir, tmp_path_factory):
    """{pp: metrics rows}, and the runs' directory."""
    tmp = tmp_path_factory.mktemp("pipeline_roles")
    torch.manual_seed(3)  # the reward model's score head: random, so its scores vary between samples
    rm = save_hf_model(load_reward_model(tiny_model_dir), tmp / "rm")
    config = grpo_config(
        tmp, tiny_model_dir, data="num_samples: 16, val_size: 2", resources="n_gpus_per_node: 2"
    )
    out = {"dir": tmp}
    for pp in (2, 1):
        assert cli_main(_args(config, tmp, rm, pp, f"pp{pp}")) == 0
        out[pp] = _rows(tmp / f"pp{pp}")
    return out


def _args(config, tmp, rm, pp: int, name: str) -> list[str]:
    return [
        "train", str(config), "algorithm.name=ppo", "algorithm.use_kl_loss=true", "reward.kind=model",
        f"model.reward_model_path={rm}", *(f"{s}.parallel.pp={pp}" for s in SECTIONS),
        "actor.micro_batch_size_per_device=2", "critic.micro_batch_size_per_device=2", "critic.optim.lr=1e-2",
        "actor.optim.eps=1e-6", "critic.optim.eps=1e-6",
        f"trainer.experiment_name={name}", f"trainer.total_steps={STEPS}", "trainer.save_every=0",
        "trainer.loggers=[jsonl]", "trainer.val_every=0", f"trainer.rollout_data_dir={tmp / name / 'gen'}",
    ]  # fmt: skip


def _rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_equal_updates(got: dict, want: dict) -> None:
    keys = [k for k in want if k.startswith(COMPARED)]
    named = {"actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "critic/vf_loss", "critic/grad_norm"}
    assert named <= set(keys) <= set(got), named - set(keys)
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (got["step"], key)
    assert got["actor/grad_norm"] > 0 and got["critic/grad_norm"] > 0


def test_ppo_with_every_model_in_two_stages_equals_one_stage(runs):
    steps = [r for r in runs[2] if r["step"] >= 1]
    assert len(steps) == STEPS
    for got, want in zip(steps, [r for r in runs[1] if r["step"] >= 1]):
        _assert_equal_updates(got, want)
    assert steps[-1]["actor/kl_loss"] > 1e-6  # the second step's KL reads a reference the actor has left


def test_reward_model_scores_equal_per_sequence(runs):
    """Each training sample's score from the two-stage reward model (its last stage reads the sequence's
    last attended token) equals the one-stage score."""
    for step in range(1, STEPS + 1):
        got, want = (
            [
                json.loads(x)
                for x in (runs["dir"] / f"pp{pp}" / "gen" / f"{step}.jsonl").read_text().splitlines()
            ]
            for pp in (2, 1)
        )
        assert [r["output"] for r in got] == [r["output"] for r in want] and len(got) == 8
        assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], rel=1e-5, abs=1e-6)
        assert len({round(r["score"], 4) for r in want}) > 1  # varied scores: the head reads each sequence


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["critic.parallel.pp=2", "model.remove_padding=true"], "model.remove_padding: true with critic.parallel.pp = 2"),
        (["critic.parallel.pp=2", "critic.parallel.tp=2", "model.lora.rank=4", "resources.n_gpus_per_node=4"],
         "model.lora.critic: true with critic.parallel.pp = 2; adapters are not applied to pipeline stages"),
        (["critic.parallel.pp=4", "resources.n_gpus_per_node=4"], "critic.parallel.pp = 4: 4 pipeline stages exceed the model's 2"),
    ],
)  # fmt: skip
def test_what_stages_do_not_run_with_fails_in_one_line(tiny_model_dir, tmp_path, capsys, overrides, expected):
    config = grpo_config(tmp_path, tiny_model_dir, resources="n_gpus_per_node: 2")
    assert cli_main(["train", str(config), "algorithm.name=ppo", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and expected in err, err
