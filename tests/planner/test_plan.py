"""Plan output: serialisation, the trainer's resource description, built-in dataflows, the CLI
commands (`hybridflow plan`, `hybridflow calibrate`)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridflow.cli import main
from hybridflow.planner import (
    ClusterSpec,
    ModelSpec,
    Plan,
    WorkloadSpec,
    build_dataflow,
    plan,
    plan_to_resources,
    strategy_name,
)
from hybridflow.planner.fit import fit_call_terms
from hybridflow.planner.profile import DeviceProfile


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_plan_round_trips_through_yaml_and_json(paper_plan, tmp_path, suffix):
    p = paper_plan("13B", 128)
    path = p.save(tmp_path / f"plan{suffix}")
    assert Plan.load(path) == p
    with pytest.raises(FileNotFoundError, match="hybridflow plan --output"):
        Plan.load(tmp_path / "missing.yaml")


def test_plan_to_resources_describes_pools_and_layouts(paper_plan):
    p = paper_plan("13B", 128)
    res = plan_to_resources(p)
    assert list(res.pools) == [pool.name for pool in p.pools]
    assert sum(res.pools.values()) <= 128
    assert set(res.models) == {"actor", "critic", "reference", "reward"}
    for role, m in res.models.items():
        assert res.pools[m.pool] == m.n_devices == m.pp * m.tp * m.dp
        assert role in m.pool.split("+")
    assert json.loads(json.dumps(res.to_dict())) == res.to_dict()  # plain data


def test_builtin_dataflows():
    b7 = ModelSpec.from_param_count("7B")
    assert build_dataflow("ppo", b7).roles == ("actor", "critic", "reference", "reward")
    assert build_dataflow("grpo", b7).roles == ("actor", "reference", "reward")
    assert build_dataflow("grpo", b7, reward_model=False).roles == ("actor", "reference")
    assert build_dataflow("safe-rlhf", b7).roles == ("actor", "critic", "reference", "reward", "cost")
    remax = build_dataflow("remax", b7, samples_per_prompt=4)
    assert remax.model("actor").generation_factor == pytest.approx(5 / 4)  # one greedy baseline per prompt
    with pytest.raises(ValueError, match="ppo"):
        build_dataflow("dpo", b7)
    with pytest.raises(KeyError, match="critic"):
        build_dataflow("grpo", b7).model("critic")


def test_grpo_and_remax_plans_and_their_costs():
    """ReMax generates one extra greedy response per prompt, so it cannot be cheaper than GRPO."""
    cluster = ClusterSpec.build("a100-80", 16)
    b7 = ModelSpec.from_param_count("7B")
    wl = WorkloadSpec(samples_per_prompt=4, prompts=256)
    grpo = plan(build_dataflow("grpo", b7, samples_per_prompt=4), cluster, wl)
    remax = plan(build_dataflow("remax", b7, samples_per_prompt=4), cluster, wl)
    assert grpo.stage_seconds["generation"] < remax.stage_seconds["generation"]
    assert [m.role for m in grpo.models] == ["actor", "reference", "reward"]


def test_strategy_names():
    roles = ["actor", "critic", "reference", "reward"]
    assert strategy_name([roles], roles) == "colocate"
    assert strategy_name([["actor"], ["critic"], ["reference"], ["reward"]], roles) == "standalone"
    assert strategy_name([["critic", "reward"], ["reference", "actor"]], roles) == "split"
    assert strategy_name([["actor", "reward"], ["critic", "reference"]], roles) == "custom"


def test_plan_command_prints_explains_and_writes(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    rc = main(
        ["plan", "--model-size", "13B", "--gpus", "32", "--gpu", "a100-80", "--explain", "--output", str(out)]
        + ["--schedule", "sync"]  # the paper's synchronous stages (test_ahead.py: one step ahead wins here)
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "colocate" in text and "split" in text and "standalone" in text  # --explain's comparison
    assert "why this plan" in text and "x the plan's time" in text
    loaded = Plan.load(out)
    assert loaded.num_devices == 32 and loaded.strategy == "colocate"


def test_plan_command_reads_an_hf_config_and_plans_cpu_devices(tiny_model_dir, capsys):
    args = [
        "plan",
        "--model-config",
        str(tiny_model_dir),
        "--gpus",
        "4",
        "--gpu",
        "cpu",
        "--algorithm",
        "grpo",
    ]
    args += ["--prompts", "8", "--prompt-len", "16", "--response-len", "16"]
    assert main(args) == 0
    assert "cpu" in capsys.readouterr().out


def test_plan_command_reports_what_does_not_fit(capsys):
    assert main(["plan", "--model-size", "70B", "--gpus", "8"]) == 2
    assert "add devices" in capsys.readouterr().out


def test_a_failed_run_timing_the_calls_is_one_line_and_writes_no_profile(tmp_path, monkeypatch, capsys):
    """step_rests' real `hybridflow train` run refusing its config comes back as the run's own last line;
    calibrate prints it in one line, exits 1 and writes nothing."""
    from hybridflow.errors import RunStopped
    from hybridflow.planner import calibrate, microbench_path

    monkeypatch.setitem(microbench_path.REST_RUN, "response_len", 0)
    with pytest.raises(
        RunStopped, match=r"1-rank GRPO run timing the calls failed \(exit 2\): .*response_length"
    ):
        microbench_path.step_rests()

    def failing(*args, **kwargs):
        raise RunStopped("the 1-rank GRPO run timing the calls failed (exit 2): bad")

    monkeypatch.setattr(calibrate, "measure_profile", failing)
    profile_path = tmp_path / "cpu.yaml"
    assert (
        main(["calibrate", "--repeats", "1", "--out", str(profile_path)]) == 1 and not profile_path.exists()
    )
    assert capsys.readouterr().out.strip() == (
        "hybridflow calibrate: the 1-rank GRPO run timing the calls failed (exit 2): bad"
    )


def test_calibrate_writes_a_profile_and_reports_predicted_measured_and_ratio(tmp_path, capsys):
    """One run of the micro-benchmarks: the profile they write loads back equal and carries what they
    measured; the table sets the catalogue's and the profile's predictions beside the measured seconds."""
    out, profile_path = tmp_path / "cal.json", tmp_path / "cpu.yaml"
    args = ["calibrate", "--batch", "2", "--prompt-len", "8", "--response-len", "4", "--repeats", "1"]
    assert main([*args, "--rounds", "0", "--out", str(profile_path)]) == 2 and not profile_path.exists()
    assert "--rounds must be at least 1" in capsys.readouterr().out
    assert main([*args, "--rest-steps", "1", "--out", str(profile_path)]) == 2 and not profile_path.exists()
    assert "--rest-steps must be at least 2" in capsys.readouterr().out
    # 6 steps a timed run (1 left out) instead of 24: the same code, ~20 s sooner
    args += ["--rest-steps", "6"]
    assert main([*args, "--rounds", "1", "--out", str(profile_path), "--results", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("stages", "profile_stages"):
        assert set(result[key]) == {"training", "inference", "generation"}
        for r in result[key].values():
            assert r["predicted_s"] > 0 and r["measured_s"] > 0
            assert r["ratio"] == pytest.approx(r["measured_s"] / r["predicted_s"])
    assert "measured / predicted" in capsys.readouterr().out
    profile = DeviceProfile.load(profile_path)
    assert DeviceProfile.load(profile.save(tmp_path / "again.json")) == profile
    raw, fp32, bf16 = profile.measurements, profile.device("float32"), profile.device("bfloat16")
    assert fp32.measured and (fp32.bytes_per_param, bf16.bytes_per_param) == (4, 2)
    assert fp32.hbm_bandwidth == raw["memory_bandwidth"] > 0 and raw["startup_s"] > 0
    assert fp32.comm_latency_s == raw["collectives"]["latency_s"] > 0
    assert fp32.intra_node_bandwidth == raw["collectives"]["bandwidth"] > 0
    # a barrier after each rank's own chunk of work: the longer chunk waits longer, and the terms fitted
    chunk_s, wait_s = raw["sync_waits"]["chunk_s"], raw["sync_waits"]["wait_s"]
    assert 0 < chunk_s[0] < chunk_s[1] and min(wait_s) > 0
    for name in ("sync_wait_s", "sync_wait_fraction"):
        assert getattr(fp32, name) == getattr(bf16, name) == raw["sync_terms"][name] >= 0
    assert fp32.layer_overhead_s == raw["float32"]["layer_overhead_s"] >= 0
    # the path's terms (microbench_path.py): the call over Ray, the training step over gloo, both dtypes
    calls = raw["worker_call"]
    assert calls["call_overhead_s"] > 0 and calls["transfer_bandwidth"] > 0
    # an empty step's four calls and the driver's work beyond them
    assert fp32.driver_step_overhead_s == calls["driver_step_overhead_s"] >= 0
    assert fp32.driver_step_overhead_s == pytest.approx(
        max(0.0, calls["empty_step_s"] - 4 * calls["call_overhead_s"])
    )
    # the calls as real runs' steps pay them: three runs' rests, fitted (fit_call_terms) into both dtypes
    assert [(r["ranks"], r["prompts"]) for r in raw["step_rests"]["runs"]] == [(1, 8), (1, 64), (2, 8)]
    assert all(r["rest_s"] > 0 for r in raw["step_rests"]["runs"])
    # the prompts as drawn (the arithmetic task's are 5-8 tokens), below the config's cap of 16
    assert all(0 < r["mean_prompt_len"] <= r["longest_prompt_len"] < 16 for r in raw["step_rests"]["runs"])
    idle = replace(fp32, transfer_bandwidth=calls["transfer_bandwidth"])  # what the fit fell back on
    assert raw["call_terms"] == fit_call_terms(raw["step_rests"], idle)
    for name in ("call_overhead_s", "call_rank_overhead_s", "transfer_bandwidth"):
        assert getattr(fp32, name) == getattr(bf16, name) == raw["call_terms"][name]
    assert fp32.call_overhead_s > 0
    for name in ("micro_batch_overhead_s", "tp_layer_overhead_s", "tp_token_overhead_s", "fsdp_layer_overhead_s",
                 "fsdp_optimizer_step_overhead_s", "tp_optimizer_step_overhead_s"):  # fmt: skip
        assert getattr(fp32, name) == getattr(bf16, name) == raw["training_path"][name] >= 0
    assert fp32.peak_flops >= 0.9 * min(raw["float32"]["gemm_flops_by_width"].values())
    # the engine's own passes, per token beyond the simulator's terms (fitted on the fp32 entry, both dtypes)
    for name in ("train_token_overhead_s", "infer_token_overhead_s", "token_overhead_width",
                 "train_batch_overhead_s", "infer_batch_overhead_s"):  # fmt: skip
        assert getattr(fp32, name) == getattr(bf16, name) == raw["engine_tokens"][name] >= 0
    assert fp32.token_overhead_width == 64  # --size tiny's hidden size
    assert raw["engine_passes"]["train_s"][1] > raw["engine_passes"]["train_s"][0] > 0  # 256 rows against 64
    # the same passes on 2 FSDP2 ranks: what d = 2 adds per token per layer pass (both dtypes, from fp32)
    dp2 = raw["engine_passes"]["dp2"]
    assert dp2["train_s"][1] > dp2["train_s"][0] > 0 and dp2["infer_s"][1] > dp2["infer_s"][0] > 0
    for name in ("fsdp_train_token_overhead_s", "fsdp_infer_token_overhead_s"):
        assert getattr(fp32, name) == getattr(bf16, name) == raw["engine_tokens"][name] >= 0
    # and as 2 pipeline stages: a stage's pass per token beyond the simulator's terms (both dtypes, from fp32)
    pp2 = raw["engine_passes"]["pp2"]
    assert pp2["train_s"][1] > pp2["train_s"][0] > 0 and pp2["infer_s"][1] > pp2["infer_s"][0] > 0
    for name in ("pipeline_train_token_overhead_s", "pipeline_infer_token_overhead_s"):
        assert getattr(fp32, name) == getattr(bf16, name) == raw["engine_tokens"][name] >= 0
    # generation's terms from the built-in engine's decode steps (per dtype) and the responses' text
    for name, spec in (("float32", fp32), ("bfloat16", bf16)):
        steps = raw[name]["decode_steps"]
        assert steps["rows"] == [1, 256] and min(steps["step_s"]) > 0
        assert spec.decode_step_overhead_s == raw[name]["decode_terms"]["decode_step_overhead_s"] >= 0
        assert spec.decode_row_overhead_s == raw[name]["decode_terms"]["decode_row_overhead_s"] >= 0
        assert spec.detokenize_row_s == raw["detokenize"]["detokenize_row_s"] >= 0
        assert spec.detokenize_token_s == raw["detokenize"]["detokenize_token_s"] > 0
    # the passes again on all the machine's cores: their parallel fractions (none to measure on one core)
    if "threads" in raw["engine_passes"]:
        assert raw["engine_passes"]["threads"]["count"] > 1
        for name in ("thread_fraction_train", "thread_fraction_infer"):
            assert getattr(fp32, name) == getattr(bf16, name) == raw["engine_tokens"][name]
            assert 0.0 <= getattr(fp32, name) <= 1.0
    # the switch's rounds on the resharders, per unit gathered beyond the bytes (fitted on fp32, both dtypes)
    assert set(raw["switch_rounds"]) == {"t1d2", "t2d1", "p2t1d1"} and min(raw["switch_rounds"].values()) > 0
    for name in ("switch_fsdp_unit_s", "switch_tp_unit_s", "switch_stage_s"):
        assert getattr(fp32, name) == getattr(bf16, name) == raw["switch_terms"][name] >= 0
    # 2,048 tokens' non-matmul work costs something on any CPU; per dtype, as measured
    assert fp32.activation_s_per_element == raw["float32"]["activation_s_per_element"] > 0
    # bf16 on a CPU without bf16 units (AVX2 only): its GEMMs, emulated, can account for the whole pass at the
    # fitted rate, and the fit is clamped at 0
    assert bf16.activation_s_per_element == raw["bfloat16"]["activation_s_per_element"] >= 0
    assert result["profile"] == profile.name == "cpu-measured"
