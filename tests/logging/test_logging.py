"""Tracker fan-out (console, JSONL with resume, TensorBoard, missing wandb) and the report PNG/HTML."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.logging import Tracker, TrackerError, build_tracker, read_metrics
from hybridflow.logging.report import PANELS, empty_panels, panel_series


def _metrics(step: int) -> dict:
    return {
        "reward/mean": step / 10,
        "val/synthetic:arithmetic/acc@1": step / 20,
        "actor/kl": torch.tensor(0.01 * step),  # tensors are accepted
        "actor/entropy": 2.0 - step / 10,
        "response_length/mean": 3.0,
        "timing_s/generate": 0.5,
        "timing_s/update_actor": 0.25,
        "perf/throughput": 100.0 + step,
        "rollout/log_prob_diff_mean": 7.6e-4,
        "not_numeric": "x",
        "nan": math.nan,
    }


def test_tracker_jsonl_console_tensorboard(tmp_path):
    out = io.StringIO()
    with Tracker(tmp_path, ["console", "jsonl", "tensorboard"], total_steps=4, stream=out) as t:
        for step in range(1, 5):
            t.log(_metrics(step), step)
        t.log_generations([{"prompt": "1+1=", "response": "2", "score": 1.0}], step=4)
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4]
    assert (
        lines[1]["actor/kl"] == pytest.approx(0.02)
        and "not_numeric" not in lines[0]
        and "nan" not in lines[0]
    )
    console = out.getvalue()
    assert (
        "step 2/4 | reward 0.200 | entropy 1.800 | len 3 | synthetic:arithmetic acc 0.100 | tok/s 102 | "
        "logp gap 7.6e-04" in console
    )
    assert "eta" in console and "val/generations (step 4)" in console and "1+1=" in console
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    kl = events.Scalars("actor/kl")  # every step's scalars, one event a step
    assert [e.step for e in kl] == [1, 2, 3, 4] and kl[1].value == pytest.approx(0.02)
    assert "not_numeric" not in events.Tags()["scalars"] and "nan" not in events.Tags()["scalars"]
    (table,) = events.Tensors("val/generations/text_summary")
    assert table.step == 4 and "1+1=" in table.tensor_proto.string_val[0].decode()
    gen = json.loads((tmp_path / "generations.jsonl").read_text())
    assert gen == {"step": 4, "table": "val/generations", "prompt": "1+1=", "response": "2", "score": 1.0}

    # resuming from step 2 drops the lines a crashed run wrote after its last checkpoint
    with Tracker(tmp_path, ["jsonl"], resume_step=2) as t:
        t.log({"reward/mean": 9.0}, 3)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and not (tmp_path / "generations.jsonl").read_text()
    with Tracker(tmp_path, ["jsonl"], resume_step=3) as t:  # one history: its steps never go back
        with pytest.raises(TrackerError, match="step 2 after step 3; a second history is never appended"):
            t.log({"reward/mean": 1.0}, 2)
        t.log({"reward/mean": 1.0}, 3)
    with Tracker(tmp_path, ["jsonl"]) as t:  # a fresh run starts the history over
        t.log({"reward/mean": 2.0}, 1)
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]


def test_optional_loggers_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed (the Makefile installs it)
    with pytest.raises(TrackerError, match="includes 'wandb' but the wandb package is not installed"):
        Tracker(tmp_path, ["wandb"])
    with pytest.raises(TrackerError, match="unknown logger"):
        Tracker(tmp_path, ["tensorbord"])
    cfg = load_config(
        None, ["model.path=m", "data.dataset=d", f"trainer.output_dir={tmp_path}", "trainer.loggers=[jsonl]"],
        check_model=False,
    )  # fmt: skip
    with build_tracker(cfg) as t:
        t.log({"a": 1}, 1)
    assert (tmp_path / "default" / "metrics.jsonl").exists()


def test_report_png_and_html(tmp_path, capsys):
    with Tracker(tmp_path, ["jsonl"]) as t:
        for step in range(1, 11):
            t.log(_metrics(step), step)
        t.log_generations([{"prompt": "<b>1+1=</b>", "response": "2"}], step=10)
    with Tracker(tmp_path, ["jsonl"], resume_step=10) as t:
        t.log({"reward/mean": 5.0}, 10)  # a later line for the same step wins
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert series["reward/mean"][-1] == (10, 5.0) and len(series["reward/mean"]) == 10
    assert panel_series(series, PANELS[5][1]) == ["timing_s/generate", "timing_s/update_actor"]

    assert main(["report", str(tmp_path), "--output", str(tmp_path / "rep")]) == 0
    png, page = tmp_path / "rep" / "report.png", tmp_path / "rep" / "report.html"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a real multi-panel figure
    text = page.read_text()
    assert "data:image/png;base64," in text and "<td>val/synthetic:arithmetic/acc@1</td>" in text
    assert "&lt;b&gt;1+1=&lt;/b&gt;" in text  # generations are escaped
    assert "wrote" in capsys.readouterr().out

    assert main(["report", str(tmp_path / "empty")]) == 1
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_report_panels_read_the_names_the_trainers_write():
    """The KL panel is the KL to the reference, not the PPO ratio drift; SFT and DPO losses are found.
    (Each panel is also checked against real runs: tests/trainers/test_drivers.py, test_cli_e2e.py,
    test_invariants.py and test_learning.py call empty_panels on what they wrote.)"""
    kl = dict(PANELS)["KL to reference"]
    assert panel_series(dict.fromkeys(["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"]), kl) == [
        "actor/reward_kl_penalty",
        "actor/kl_loss",
    ]
    assert "KL to reference" in empty_panels(["actor/ppo_kl"])
    losses = dict(PANELS)["Losses"]
    assert panel_series(dict.fromkeys(["sft/loss", "dpo/loss", "actor/pg_loss"]), losses) == [
        "actor/pg_loss",
        "dpo/loss",
        "sft/loss",
    ]


def test_phase_panel_keeps_the_largest_phases():
    """More phases than a panel holds: the smallest go, not the last alphabetically (update_actor)."""
    phases = ["adv", "gen", "old_log_prob", "ref", "reshard", "reward", "save", "step", "update_actor"]
    sizes = {"adv": 0.01, "save": 0.02, "update_actor": 9.0}  # the rest: 1.0 s each
    series = {f"timing_s/{p}": [(1, sizes.get(p, 1.0)), (2, sizes.get(p, 1.0))] for p in phases}
    kept = panel_series(series, dict(PANELS)["Time per phase (s)"])
    assert len(kept) == 8 and "timing_s/update_actor" in kept and "timing_s/adv" not in kept
    assert kept == sorted(kept)  # still in name order on the panel
