"""The README's example config per algorithm (examples/configs/), each through `hybridflow train` for 2 steps
as its comment says to run it (from the repository root: the cost function, the preference file), on the
tiny model: it trains its algorithm (the algorithm's own metrics are written) and validates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridflow.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
# config -> metrics its algorithm writes at every step (beside the validation's)
EXAMPLES = {
    "rloo_tiny.yaml": ["actor/pg_loss"],
    "remax_tiny.yaml": ["actor/pg_loss"],
    "reinforce_pp_tiny.yaml": ["actor/pg_loss", "actor/reward_kl_penalty"],  # KL folded into the reward
    "safe_rlhf_tiny.yaml": ["safe_rlhf/lambda", "safe_rlhf/cost_mean", "cost_critic/vf_loss"],
    "dpo_tiny.yaml": ["dpo/loss", "dpo/reward_margin"],
    "grpo_reasoning_gym_tiny.yaml": ["actor/pg_loss", "reward/mean"],
}
SOURCE = {"grpo_reasoning_gym_tiny.yaml": "reasoning_gym:chain_sum"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_config_trains_two_steps(name, ray_cluster, tiny_model_dir, tmp_path, monkeypatch, capsys):
    if "reasoning_gym" in name:
        pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra (`make venv` installs it)")
    assert f"`{name}`" in (ROOT / "README.md").read_text(), f"the README does not list {name}"
    monkeypatch.chdir(ROOT)
    # smaller batches and one validation keep it cheap; every algorithm setting is the config's own
    argv = ["train", str(CONFIGS / name), f"model.path={tiny_model_dir}", "trainer.total_steps=2",
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "trainer.val_before_train=false",
            f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]", "trainer.save_every=0"]  # fmt: skip
    assert cli_main(argv) == 0, capsys.readouterr().err[-3000:]
    run = next(tmp_path.iterdir())
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for step in (1, 2):
        for key in EXAMPLES[name]:
            assert math.isfinite(rows[step][key]), (step, key)
    acc = rows[2][f"val/{SOURCE.get(name, 'synthetic:arithmetic')}/acc@1"]
    assert 0.0 <= acc <= 1.0
    if name == "safe_rlhf_tiny.yaml":  # the config's multiplier: lambda_init 0, lambda_lr 0.5, cost_limit 0.1
        cost = rows[1]["safe_rlhf/cost_mean"]
        assert rows[1]["safe_rlhf/lambda"] == pytest.approx(max(0.0, 0.5 * (cost - 0.1)))
    if name == "dpo_tiny.yaml":  # step 1: the actor is its reference, each pair's loss is log 2
        assert rows[1]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-4)
