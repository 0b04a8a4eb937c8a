"""Smoke test of benchmarks/vs_trl.py's harness: both sides run 2 real iterations on the tiny model and
report what the table is built from (equal, exact token counts; phases that add up to the iteration).

Speed is never asserted (preamble); this only guards that the comparison stays like-for-like.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import vs_trl  # noqa: E402

B, N, LR = 2, 2, 8
PROMPT_TOKENS = 6  # "<|user|>" + "a+b=" + "<|assistant|>" with single-digit operands
TOKENS = B * N * (PROMPT_TOKENS + LR)


def _side_args(tmp_path, model_dir) -> list[str]:
    return [
        "--model", str(model_dir), "--workdir", str(tmp_path), "--steps", "2", "--batch-size", str(B),
        "--n", str(N), "--response-length", str(LR), "--lr", "1e-3", "--kl-coef", "0.01",
    ]  # fmt: skip


def _check_steps(result: dict) -> None:
    assert len(result["steps"]) == 2 and len(result["rewards"]) == 2
    for step in result["steps"]:
        assert step["tokens"] == TOKENS  # every response ran to exactly LR tokens
        parts = sum(step[p] for p in vs_trl.PHASES if p != "other")
        assert 0 < parts <= step["iteration"] + 1e-6
        assert step["generation"] > 0 and step["ref"] > 0 and step["update"] > 0
        assert step["cpu"] > 0
    assert all(0.0 <= r <= 1.0 for r in result["rewards"])


def test_hybridflow_side(ray_cluster, tiny_model_dir, tmp_path):
    import vs_trl_hybridflow

    args = vs_trl_hybridflow.parse_args(_side_args(tmp_path, tiny_model_dir))
    result = vs_trl_hybridflow.run(args)
    _check_steps(result)
    assert all(s["old"] < 0.05 for s in result["steps"])  # on-policy: rollout log-probs reused


def test_trl_side(tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("trl", reason="TRL comes with the bench extra (make bench)")
    import vs_trl_trl

    assert vs_trl_trl.main(_side_args(tmp_path, tiny_model_dir) + ["--threads", "1"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1]
    result = json.loads(line)
    _check_steps(result)
    assert all(s["old"] == 0.0 for s in result["steps"])  # TRL skips it when aligned, as we do


def test_summary_and_table():
    steps = [
        {"generation": g, "ref": 1.0, "old": 0.0, "values": 0.0, "reward": 0.0, "update": 2.0, "other": 0.0,
         "iteration": g + 3.0, "cpu": 5.0, "tokens": 100.0}
        for g in (9.0, 1.0, 2.0, 3.0)
    ]  # fmt: skip
    s = vs_trl.summarize({"steps": steps}, warmup=1)
    assert s["measured_steps"] == 3 and s["generation"] == 2.0 and s["iteration"] == 5.0
    assert s["tokens"] == 100.0 and s["tokens_equal"]
    half = dict(s, iteration=2.5, cpu=2.5, best=2.0)
    table = vs_trl.throughput_table([{"size": "tiny", "length": 8, "seqs": 4, "trl": s, "hybridflow": half}])
    assert "| 5.00 | 2.50 | 20 | 40 | **2.00x** | 2.00x | 5.00 | 2.50 | 2.00x |" in table


def test_curve_table_blocks_and_summary():
    curves = {"trl": [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], "hybridflow": [0.1, 0.1, 0.1, 0.5, 0.5, 0.5]}
    table = vs_trl.curve_table(curves, tail=3, block=3)
    assert "| 1-3 | 0.200 | 0.100 |" in table and "| 4-6 | 0.800 | 0.500 |" in table
    # trl first 3 = (0, .2, .4): mean .2, s.e. = stdev .2 / sqrt 3 = .115
    assert "trl: mean reward, first 3 iterations 0.200 +- 0.115, last 3 0.800 +- 0.115 (s.e.)" in table
    assert "hybridflow: mean reward, first 3 iterations 0.100 +- 0.000, last 3 0.500 +- 0.000" in table


def test_natural_eos_table_pools_trl_runs_and_names_the_best_ahead_setting():
    import vs_trl_eos

    runs = [{"steps": [{"tokens": 1.0, "iteration": 9.0}, {"tokens": 100.0, "iteration": 1.0}]},
            {"steps": [{"tokens": 1.0, "iteration": 9.0}, {"tokens": 300.0, "iteration": 2.0}]}]  # fmt: skip
    pooled = vs_trl_eos.pooled_steps(runs, warmup=1)  # the warm-up step of each run left out
    assert [s["tokens"] for s in pooled] == [100.0, 300.0]
    base = {"rate": 100.0, "response_mean": 1.0, "cpu_rate": 1.0, "generation": 1.0, "iteration": 2.0}
    row = {"size": "m", "length": 32, "trl": base, "trl_runs": [dict(base, rate=90.0), dict(base, rate=110.0)],
           "sync": {"dp=1": dict(base, rate=120.0)}, "ahead": {"rate": 150.0}, "ahead_both": {"rate": 160.0}}  # fmt: skip
    assert vs_trl_eos.best_ahead(row) == ("frozen_pool=both", {"rate": 160.0})
    line = vs_trl_eos.natural_table([row]).splitlines()[-1]
    assert "| 160 | **1.60x** | frozen_pool=both |" in line and line.endswith("| 90, 110 |")
    row["precision"] = "bf16"  # TRL's default: bf16=True
    assert "| m | 32 | bf16 (TRL default) |" in vs_trl_eos.natural_table([row])
    # the headline: TRL at its defaults (the bf16 row) against hybridflow's fastest run at either precision
    fp32 = dict(row, precision="fp32", trl=dict(base, rate=50.0), ahead_both={"rate": 250.0})
    line = vs_trl_eos.headline_table([row, fp32]).splitlines()[-1]
    assert (
        line == "| m | 32 | 100 | 250 | **2.50x** | model.dtype=float32, rollout_ahead=1, frozen_pool=both |"
    )


def test_precision_sets_both_sides_dtype():
    import vs_trl_hybridflow

    base = ["--model", "m", "--workdir", "w"]
    for prec, dtype in (("bf16", "bfloat16"), ("fp32", "float32")):
        args = vs_trl_hybridflow.parse_args([*base, "--precision", prec])
        assert f"model.dtype={dtype}" in vs_trl_hybridflow.overrides(args)
