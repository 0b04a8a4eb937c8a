"""No silent failures through the real `hybridflow train` (Ray, worker groups, tiny model): a broken reward
and a diverged update each stop the run with exit 2 and one line naming the step and the cause, instead
of training on garbage (or skipping every step) and exiting 0."""

from __future__ import annotations

import json

from hybridflow.cli import main as cli_main

BASE = [
    "data.dataset_kwargs={num_samples: 16, val_size: 4, max_operand: 9}",
    "data.max_prompt_length=16",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "rollout.response_length=4",
    "reward.num_workers=0",
    "resources.device=cpu",
    "resources.n_gpus_per_node=1",
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
]


def _train(config: list[str], capsys) -> tuple[int, str]:
    rc = cli_main(["train", *config])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("hybridflow train:")]
    assert len(lines) == 1, lines
    return rc, lines[0]


def test_a_reward_of_1e30_stops_the_run_at_step_1(ray_cluster, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "r.py").write_text(
        "def huge(data_source, solution_str, ground_truth, extra_info=None):\n    return 1e30\n"
    )
    (tmp_path / "c.yaml").write_text("algorithm: {name: grpo}\nrollout: {n: 2}\n")
    rc, line = _train(
        [str(tmp_path / "c.yaml"), *BASE, f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic",
         f"reward.fn={tmp_path}/r.py:huge", f"trainer.output_dir={tmp_path}", "trainer.total_steps=3"],
        capsys,
    )  # fmt: skip
    assert rc == 2
    assert line.startswith("hybridflow train: step 1: the reward function failed on 8 of 8 samples")
    assert "exceeds reward.max_abs_score=1e+06" in line and "reward.max_error_fraction=0.5" in line


def test_consecutive_skipped_updates_stop_the_run(ray_cluster, tiny_model_dir, tmp_path, capsys):
    """SFT with an absurd learning rate: step 1's update blows the weights up, the next losses are not
    finite, their optimizer steps are skipped; after trainer.max_skipped_steps=2 the run stops at step 3."""
    (tmp_path / "c.yaml").write_text("algorithm: {name: sft}\n")
    rc, line = _train(
        [str(tmp_path / "c.yaml"), *BASE, f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic_sft",
         "actor.optim.lr=1e30", "trainer.max_skipped_steps=2", f"trainer.output_dir={tmp_path}",
         "trainer.total_steps=10", "trainer.experiment_name=nan"],
        capsys,
    )  # fmt: skip
    assert rc == 2
    assert line.startswith("hybridflow train: step 3: the update was skipped in 2 consecutive steps")
    assert "sft/grad_norm" in line and "trainer.max_skipped_steps=2" in line
    rows = [json.loads(x) for x in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the failing steps are logged, not vanished
    assert [r.get("sft/step_skipped", 0) for r in rows] == [0, 1, 1]


def test_an_update_that_overflows_the_weights_stops_before_any_save(
    ray_cluster, tiny_model_dir, tmp_path, capsys
):
    """lr 1e39 is a finite float but not a finite fp32 step: step 1's update makes weights inf. The run stops
    at once in one line, its row logged, no checkpoint of the poisoned weights written (was: saved)."""
    (tmp_path / "c.yaml").write_text("algorithm: {name: sft}\n")
    rc, line = _train(
        [str(tmp_path / "c.yaml"), *BASE, f"model.path={tiny_model_dir}", "data.dataset=synthetic:arithmetic_sft",
         "actor.optim.lr=1e39", "actor.optim.weight_decay=0", f"trainer.output_dir={tmp_path}",
         "trainer.total_steps=2", "trainer.save_every=1", "trainer.experiment_name=inf"],
        capsys,
    )  # fmt: skip
    assert rc == 2
    assert line.startswith(
        "hybridflow train: step 1: the update made weights non-finite (sft/params_nonfinite)"
    )
    rows = [json.loads(x) for x in (tmp_path / "inf" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sft/params_nonfinite"], r["sft/step_skipped"]) for r in rows] == [(1, 1.0, 0.0)]
    assert not (tmp_path / "inf" / "checkpoints").exists() or not list(
        (tmp_path / "inf" / "checkpoints").glob("step_*")
    )
