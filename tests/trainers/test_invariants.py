"""Invariants of the drivers: placement does not change the numbers; the CLI runs a config end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hybridflow.cli import main as cli_main
from hybridflow.logging.report import empty_panels
from hybridflow.models import load_reward_model, save_hf_model
from hybridflow.trainers import Placement, build_trainer

KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm", "reward/mean",
        "actor/reward_kl_penalty", "response_length/mean", "val/reward/mean")  # fmt: skip


@pytest.fixture
def reward_model_dir(tiny_model_dir, tmp_path):
    torch.manual_seed(3)
    return save_hf_model(load_reward_model(tiny_model_dir), tmp_path / "rm")


def _run(cfg, placement):
    with build_trainer(cfg, placement) as trainer:
        return trainer.fit()


def test_colocated_and_split_placements_give_the_same_losses(ray_cluster, make_config, reward_model_dir):
    """PPO with actor, critic, reference and a reward model: all four colocated on one device, vs.
    actor | critic | reference + reward on three pools. Same seed -> the same numbers, step by step."""
    cfg = make_config(
        "ppo", "reward.kind=model", f"model.reward_model_path={reward_model_dir}", "algorithm.kl.in_reward=true",
        "actor.ppo_mini_batch_size=2", "trainer.total_steps=2",
    )  # fmt: skip
    colocated = _run(cfg, Placement({"global": 1}))
    split = Placement(
        {"actor": 1, "critic": 1, "ref": 1},
        {"actor_rollout": "actor", "critic": "critic", "ref": "ref", "reward": "ref"},
    )
    separate = _run(cfg, split)
    assert len(colocated) == len(separate) == 3
    for a, b in zip(colocated[1:], separate[1:]):
        for key in (k for k in KEYS if k in a or k in b):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key
    assert "val/reward/mean" in colocated[2]
    assert colocated[1]["critic/vf_loss"] > 0 and colocated[2]["actor/grad_norm"] > 0


def test_cli_trains_dpo_from_a_yaml_config(ray_cluster, tiny_model_dir, tmp_path):
    """`hybridflow train CONFIG overrides` end to end, with DPO (actor + reference, preference pairs)."""
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(
        "algorithm: {name: dpo, dpo: {beta: 0.5}}\n"
        f"model: {{path: {tiny_model_dir}}}\n"
        "data: {dataset: 'synthetic:arithmetic_dpo', dataset_kwargs: {num_samples: 4, val_size: 4},"
        " max_prompt_length: 16, train_batch_size: 4, shuffle: false}\n"
        "actor: {ppo_mini_batch_size: 4, micro_batch_size_per_device: 3, optim: {lr: 1.0e-3}}\n"
        "rollout: {response_length: 3}\n"
        "resources: {device: cpu, n_gpus_per_node: 1}\n"
    )
    rc = cli_main(["train", str(cfg), "trainer.total_steps=2", f"trainer.output_dir={tmp_path}",
                   "trainer.experiment_name=cli", "trainer.loggers=[jsonl]", "reward.num_workers=0"])  # fmt: skip
    assert rc == 0
    rows = {
        r["step"]: r for r in map(json.loads, (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines())
    }
    assert {0, 1, 2} <= set(rows) and "val/synthetic:arithmetic/acc@1" in rows[2]
    # step 1: the actor equals the reference, so the implicit rewards are 0 and the loss is log 2;
    # step 2 sees the same 4 pairs after one update: the chosen answers now win
    assert rows[1]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert rows[1]["dpo/reward_margin"] == pytest.approx(0.0, abs=1e-4)
    assert rows[2]["dpo/reward_margin"] > 0.01 and rows[2]["dpo/loss"] < math.log(2)
    written = {k for r in rows.values() for k in r}  # the report finds DPO's loss and implicit rewards
    assert empty_panels(written) == [
        "KL to reference",
        "Entropy",
        "Response length (tokens)",
        "Train vs rollout log-prob gap",
    ]
    assert (tmp_path / "cli" / "checkpoints" / "step_2" / "trainer_state.json").is_file()
    # the same command with more steps resumes from the step-2 checkpoint and runs only step 3
    rc = cli_main(["train", str(cfg), "trainer.total_steps=3", f"trainer.output_dir={tmp_path}",
                   "trainer.experiment_name=cli", "trainer.loggers=[jsonl]", "reward.num_workers=0"])  # fmt: skip
    assert rc == 0
    lines = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    assert lines[3]["dpo/loss"] < lines[2]["dpo/loss"]  # model and optimizer state came back
