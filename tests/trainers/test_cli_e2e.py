"""The CLI end to end on the tiny setup, as a user runs it: `hybridflow train` (checkpoint, progress
lines, JSONL, TensorBoard, generations table, report), the same command again to resume, `hybridflow
export` loaded with transformers, `hybridflow eval` from the checkpoint and from the export, and a
config typo that fails in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybridflow.cli import main as cli_main
from hybridflow.logging import read_metrics
from hybridflow.logging.report import empty_panels
from tests.trainers.lifecycle_helpers import grpo_config

ACC = "val/synthetic:arithmetic/acc@1"


@pytest.fixture
def config_file(tiny_model_dir, tmp_path):
    return grpo_config(
        tmp_path,
        tiny_model_dir,
        data="num_samples: 32, val_size: 6",
        trainer="experiment_name: run, save_every: 1, keep_last: 2, loggers: [console, jsonl, tensorboard], "
        "val_generations_to_log: 3",
    )


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_resume_export_eval(ray_cluster, config_file, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli_main(["train", str(config_file), "trainer.total_steps=2"]) == 0
    err = capsys.readouterr().err
    assert "step 2/2" in err and "eta" in err and "reward" in err and "tok/s" in err  # progress lines
    assert "val/generations" in err  # the generations table
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]
    assert (run / "report.png").stat().st_size > 10_000 and (run / "report.html").is_file()
    assert empty_panels(read_metrics(run / "metrics.jsonl")) == ["KL to reference"]  # GRPO without a KL term
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    gens = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert {g["step"] for g in gens} == {0, 2} and len(gens) == 6 and "response_text" in gens[0]

    # the same command with more steps resumes at step 2 and runs step 3 only
    assert cli_main(["train", str(config_file), "trainer.total_steps=3"]) == 0
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_2", "step_3"]

    # export -> a plain HF directory that transformers loads, holding the step-3 weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "export"
    assert cli_main(["export", str(run), "--output", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("3+4=", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], tok.vocab_size)
    from hybridflow.checkpoint.shards import read_full, tensor_index

    shards = tensor_index(run / "checkpoints" / "step_3" / "actor" / "model")  # what the ranks wrote
    for name, a in model.state_dict().items():
        assert torch.equal(a, read_full(name, shards[name])), name
    base = AutoModelForCausalLM.from_pretrained(_model_dir(config_file))
    assert not torch.equal(model.lm_head.weight, base.lm_head.weight)  # training moved it

    # eval from the checkpoint and from the export: the run's own step-3 validation numbers
    capsys.readouterr()
    assert cli_main(["eval", str(run), "--output", str(tmp_path / "m.json")]) == 0
    printed = capsys.readouterr().out
    assert f"{ACC} = {rows[3][ACC]:.4f}" in printed
    gens = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    by_step = {s: [g["response_text"] for g in gens if g["step"] == s] for s in (0, 3)}
    assert by_step[0] != by_step[3]  # greedy answers moved with training: the texts pin the weights
    for text in by_step[3]:
        assert f" {text} " in printed  # eval printed the step-3 model's own greedy answers
    assert json.loads((tmp_path / "m.json").read_text())[ACC] == pytest.approx(rows[3][ACC], abs=1e-9)
    assert (
        cli_main(["eval", str(out), "--config", str(config_file), "--output", str(tmp_path / "x.json")]) == 0
    )
    assert json.loads((tmp_path / "x.json").read_text())[ACC] == pytest.approx(rows[3][ACC], abs=1e-9)
    printed = capsys.readouterr().out
    assert all(f" {text} " in printed for text in by_step[3])
    # sampled validation, 2 per prompt: acc@1 (first samples), mean@2, best@2
    assert cli_main(["eval", str(run), "rollout.val.n=2", "rollout.val.temperature=1.0", "--step", "2",
                     "--output", str(tmp_path / "n2.json")]) == 0  # fmt: skip
    n2 = json.loads((tmp_path / "n2.json").read_text())
    mean, best = n2["val/synthetic:arithmetic/mean@2"], n2["val/synthetic:arithmetic/best@2"]
    assert 0 <= mean <= best <= 1 and ACC in n2


def _model_dir(config_file: Path) -> str:
    import yaml

    return yaml.safe_load(config_file.read_text())["model"]["path"]


def test_config_typo_fails_in_one_line(config_file, capsys):
    assert cli_main(["train", str(config_file), "actor.optim.lrr=1e-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "unknown key 'actor.optim.lrr'" in err and "'actor.optim.lr'" in err
    assert cli_main(["eval", str(config_file.parent), "--step", "5"]) == 2  # no such checkpoint
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("hybridflow eval:")
    assert cli_main(["eval", _model_dir(config_file)]) == 2  # an HF directory, but no validation data named
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no validation data" in err and "--config" in err


@pytest.mark.parametrize(
    "override,expected",
    [
        ("rollout.gpu_memory_utilization=0.9", "rollout.gpu_memory_utilization: 0.9 is a vLLM setting"),
        ("rollout.pg=2", "rollout.pg = 2: generation pipeline parallelism does not exist yet"),
        ("algorithm.adv_estimator=gae", "algorithm.adv_estimator: 'gae' is not grpo's estimator"),
        ("actor.num_mini_batches=3", "actor.num_mini_batches: is derived"),
        (
            "data.train_batch_size=6",
            "actor.ppo_mini_batch_size: data.train_batch_size 6 is not divisible by 4",
        ),
    ],
)
def test_unsupported_or_inconsistent_settings_fail_in_one_line(config_file, capsys, override, expected):
    """Settings accepted by the schema but not implemented (or contradicting what is derived) stop
    `hybridflow train` before Ray starts, with one line naming the key."""
    assert cli_main(["train", str(config_file), override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and expected in err, err
