"""trainer.val_only and the generation dumps (trainer.rollout_data_dir, validation_data_dir) through the
real `hybridflow train` on the tiny setup: verl's command line with val_only validates the initial weights
and trains nothing; a 2-step run writes each step's rollouts and each validation's generations as verl's
JSONL, whose scores are the ones the metrics averaged; val_only on the finished run validates its last
checkpoint again, to the same numbers, writing no checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hybridflow.cli import main

ACC = "val/synthetic:arithmetic/acc@1"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _argv(model_dir, tmp_path, *extra: str) -> list[str]:
    return [
        "train", "algorithm.name=grpo", f"model.path={model_dir}", "data.dataset=synthetic:arithmetic",
        "data.dataset_kwargs={num_samples: 8, val_size: 3, max_operand: 9}", "data.max_prompt_length=16",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.optim.lr=1e-3", "rollout.n=2",
        "rollout.response_length=4", "reward.num_workers=0", "resources.device=cpu", "trainer.total_steps=2",
        f"trainer.output_dir={tmp_path}", "trainer.experiment_name=run", "trainer.loggers=[jsonl]",
        f"trainer.validation_data_dir={tmp_path / 'val'}", *extra,
    ]  # fmt: skip


def _check_rows(rows: list[dict], step: int, count: int) -> None:
    assert len(rows) == count
    for r in rows:
        assert list(r)[:5] == ["input", "output", "gts", "score", "step"] and r["step"] == step
        a, b = re.search(r"(\d+)\+(\d+)=", r["input"]).groups()  # the rendered prompt holds "a+b="
        assert r["gts"] == str(int(a) + int(b)) and r["score"] in (0.0, 1.0)


def test_val_only_and_the_generation_dumps(ray_cluster, tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    # verl's command line: val_only validates the initial weights, then exits without training
    verl = ["--verl", f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.n=2",
            "trainer.val_only=True"]  # fmt: skip
    argv = [
        a for a in _argv(tiny_model_dir, tmp_path, *verl) if not a.startswith(("model.path", "rollout.n"))
    ]
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    (only,) = _jsonl(run / "metrics.jsonl")
    assert only["step"] == 0 and ACC in only and not any(k.startswith("actor/") for k in only)
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step_*"))
    val0 = _jsonl(tmp_path / "val" / "0.jsonl")
    _check_rows(val0, 0, 3)
    assert only[ACC] == pytest.approx(sum(r["score"] for r in val0) / 3)

    # 2 training steps: each step's rollouts (4 prompts x 2) and each validation's generations
    argv = _argv(tiny_model_dir, tmp_path, f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")
    assert main(argv) == 0, capsys.readouterr().err[-3000:]
    rows = {r["step"]: r for r in _jsonl(run / "metrics.jsonl")}
    for step in (1, 2):
        dumped = _jsonl(tmp_path / "rollouts" / f"{step}.jsonl")
        _check_rows(dumped, step, 8)
        assert rows[step]["reward/mean"] == pytest.approx(sum(r["score"] for r in dumped) / 8)
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["0.jsonl", "2.jsonl"]
    val2 = _jsonl(tmp_path / "val" / "2.jsonl")
    _check_rows(val2, 2, 3)
    assert rows[2][ACC] == pytest.approx(sum(r["score"] for r in val2) / 3)

    # val_only on the finished run: its step-2 checkpoint validated again (greedy: the same answers)
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    (tmp_path / "val" / "2.jsonl").unlink()
    assert main(_argv(tiny_model_dir, tmp_path, "trainer.val_only=true")) == 0, capsys.readouterr().err[
        -3000:
    ]
    assert "done, 2 steps" in capsys.readouterr().out
    assert _jsonl(tmp_path / "val" / "2.jsonl") == val2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints  # nothing saved
    last = _jsonl(run / "metrics.jsonl")[-1]
    assert last["step"] == 2 and last[ACC] == rows[2][ACC] and not any(k.startswith("actor/") for k in last)


def test_rollout_data_dir_without_rollouts_is_refused_before_anything_starts(make_config, tmp_path):
    from hybridflow.config import ConfigError
    from hybridflow.trainers import build_trainer

    cfg = make_config(
        "sft", "data.dataset=synthetic:arithmetic_sft", f"trainer.rollout_data_dir={tmp_path}/r"
    )
    with pytest.raises(ConfigError, match="trainer.rollout_data_dir: sft samples no rollouts; remove it"):
        build_trainer(cfg)
    assert not (tmp_path / "runs").exists()
