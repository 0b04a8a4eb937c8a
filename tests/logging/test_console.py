"""What a user watches on the console: the step line's fields (loss, KL, entropy, response length, each
weighted reward function's mean) and the validation table cut to a few rows, the full one in the run dir."""

from __future__ import annotations

import io
import json

from hybridflow.logging import Tracker
from hybridflow.logging.backends import TABLE_CELL, TABLE_ROWS

PPO = {"reward/mean": 0.5, "actor/pg_loss": -0.01234, "actor/kl_loss": 0.00031, "actor/entropy": 1.25,
       "response_length/mean": 87.4}  # fmt: skip


def _line(metrics: dict, step: int = 1) -> str:
    out = io.StringIO()
    with Tracker("unused", ["console"], total_steps=10, stream=out) as t:
        t.log(metrics, step)
    return out.getvalue().splitlines()[0]


def test_step_line_has_loss_kl_entropy_and_response_length():
    line = _line(PPO)
    assert line.startswith(
        "step 1/10 | reward 0.500 | loss -0.01234 | kl 3.10e-04 | entropy 1.250 | len 87 |"
    )
    # the KL in the reward when there is no KL loss; SFT and DPO show their own loss
    assert "kl 2.00e-03" in _line({"actor/pg_loss": 0.1, "actor/reward_kl_penalty": 0.002})
    assert "| loss 2.312 |" in _line({"sft/loss": 2.3125})
    assert "| loss 0.6931 |" in _line({"dpo/loss": 0.693147})


def test_weighted_rewards_show_each_functions_mean_not_an_acc():
    metrics = {"reward/mean": -0.1, "reward/fmt/mean": 0.9, "reward/correct/mean": 0.25,
               "reward/extra/acc/mean": 0.3, "reward/num_errors": 0.0,
               "val/gsm8k/acc@1": -0.1, "val/reward/fmt/mean": 1.0, "val/reward/correct/mean": 0.0,
               "val/reward/mean": -0.1}  # fmt: skip
    line = _line(metrics)
    assert "| reward -0.100 | fmt 0.900 | correct 0.250 |" in line
    assert "| val fmt 1.000 | val correct 0.000 |" in line
    assert "acc" not in line and "extra" not in line and "num_errors" not in line
    # one function: its acc@1 is an accuracy, shown as before
    assert "| gsm8k acc 0.750 |" in _line({"val/gsm8k/acc@1": 0.75})


def test_validation_table_is_cut_and_written_whole(tmp_path):
    chat = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" * 4
    rows = [{"prompt_text": f"{chat}<|im_start|>user\nWhat is {i}+{i}?", "response_text": "x " * 200,
             "score": float(i)} for i in range(10)]  # fmt: skip
    out = io.StringIO()
    with Tracker(tmp_path, ["console"], stream=out) as t:
        t.log_generations(rows, step=3)
    text = out.getvalue()
    assert "What is 3+3?" in text and "What is 4+4?" not in text  # TABLE_ROWS rows; a prompt keeps its end
    assert len(text.splitlines()) <= TABLE_ROWS + 8  # title, rules, header and the note: not dozens
    assert max(len(ln) for ln in text.splitlines()) <= 160
    full = tmp_path / "val" / "generations" / "step_3.jsonl"
    assert f"val/generations: {TABLE_ROWS} of 10 rows shown; every row, uncut: {full}" in text
    assert [json.loads(ln) for ln in full.read_text().splitlines()] == rows
    assert TABLE_CELL < len(rows[0]["response_text"])


def test_startup_line_comes_before_torch_is_imported():
    """`hybridflow train` says what it runs from the config as given: no torch, Ray or model look-up
    first (those take seconds), so the line is there at once."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import argparse, sys\n"
        "from hybridflow.trainers.cli import add_arguments, say_startup\n"
        "p = argparse.ArgumentParser(); add_arguments(p)\n"
        "say_startup(p.parse_args(['examples/configs/grpo_tiny.yaml', 'resources.device=cpu']))\n"
        "print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "hybridflow train: grpo on runs/demo/models/sft; 1 device(s) (1 node x 1, cpu); actor dp auto tp 1 "
        "pp 1, rollout tg 1; placement colocate, one pool; run dir runs/grpo_tiny",
        "no torch",
    ]


def test_a_run_with_weighted_rewards_shows_each_functions_mean(ray_cluster, tiny_model_dir, tmp_path, capsys):
    """`hybridflow train` with two weighted reward functions: the step line names each one's mean, in
    training and validation (its acc@1 would be their weighted sum), and the table's rows are written."""
    from hybridflow.cli import main

    argv = ["examples/configs/grpo_tiny.yaml", f"model.path={tiny_model_dir}",
            "data.dataset_kwargs={num_samples: 0, val_size: 6, max_operand: 19}", "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4", "rollout.n=2", "trainer.total_steps=1", "trainer.val_every=1",
            "trainer.loggers=[console]", f"trainer.output_dir={tmp_path}", "trainer.val_generations_to_log=6",
            "reward.fns=[{fn: synthetic:arithmetic}, {fn: format, weight: 0.1, fn_kwargs: {fmt: boxed}}]"]  # fmt: skip
    assert main(["train", *argv]) == 0
    err = capsys.readouterr().err
    step = next(ln for ln in err.splitlines() if ln.startswith("step 1/1 |"))
    for field in ("reward", "arithmetic", "format", "loss", "entropy", "len", "val arithmetic", "val format"):
        assert f"| {field} " in step, step
    assert " acc " not in step
    full = tmp_path / "grpo_tiny" / "val" / "generations" / "step_1.jsonl"
    assert f"val/generations: {TABLE_ROWS} of 6 rows shown; every row, uncut: {full}" in err
    assert len(full.read_text().splitlines()) == 6
