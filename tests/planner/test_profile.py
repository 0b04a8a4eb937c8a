"""Device profiles (planner/profile.py): the file round-trips and refuses what it cannot read, a plan made
with one differs from the catalogue's exactly where its coefficients do, and the GEMM fit recovers a known
curve. `hybridflow calibrate --out` writing a real one is tested with the command (test_plan.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridflow.cli import main
from hybridflow.planner import ClusterSpec, EngineLimits, ModelSpec, WorkloadSpec, build_dataflow, plan
from hybridflow.planner.fit import REST_RUN, fit_call_terms
from hybridflow.planner.microbench import fit_gemm
from hybridflow.planner.microbench_path import fit_training_path
from hybridflow.planner.profile import PATH_FIELDS, PROFILE_VERSION, DeviceProfile
from hybridflow.planner.specs import get_device

# the tiny "small" Llama (hybridflow.models.tiny) and a batch like examples/configs/grpo_tiny.yaml's
SMALL = ModelSpec(
    "small", num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, ffn_hidden=384, vocab_size=64
)
WORKLOAD = WorkloadSpec(
    prompts=64, samples_per_prompt=8, prompt_len=16, response_len=4, mini_batches=1,
    micro_batch_size=256, inference_micro_batch_size=256,
)  # fmt: skip
LIMITS = EngineLimits(max_pp=1, max_pg=1, tp_shards_whole_heads=True)


def _profile(**changes) -> DeviceProfile:
    cpu = replace(get_device("cpu"), name="cpu-measured", measured=True, **changes)
    bf16 = replace(cpu, name="cpu-bf16-measured", bytes_per_param=2, peak_flops=3 * cpu.peak_flops)
    return DeviceProfile(
        "cpu-measured", {"float32": cpu, "bfloat16": bf16}, {"threads": 1}, {"startup_s": 2.5}
    )


def _load_old(tmp_path, version: int, dropped, **changes) -> DeviceProfile:
    """A profile written at `version`, without the `dropped` fields later versions added, loaded back."""
    data = _profile(**changes).to_dict()
    data["version"] = version
    for spec in data["devices"].values():
        for name in dropped:
            spec.pop(name)
    path = tmp_path / f"v{version}.json"
    path.write_text(json.dumps(data))
    return DeviceProfile.load(path)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trips(tmp_path, suffix):
    path = dict(call_overhead_s=9e-3, transfer_bandwidth=3e8, micro_batch_overhead_s=5e-3,
                tp_layer_overhead_s=4e-3, fsdp_layer_overhead_s=2e-3, optimizer_layer_overhead_s=1e-3,
                optimizer_step_overhead_s=1e-4)  # fmt: skip
    assert set(path) == set(PATH_FIELDS)
    profile = _profile(layer_overhead_s=2e-4, activation_s_per_element=3e-9, **path)
    loaded = DeviceProfile.load(profile.save(tmp_path / f"cpu{suffix}"))
    assert loaded == profile and loaded.notes == ()
    assert all(getattr(loaded.device("float32"), k) == v for k, v in path.items())
    assert loaded.device("float32").activation_s_per_element == 3e-9
    assert loaded.device("bfloat16").bytes_per_param == 2 and loaded.device("float32").measured


def test_rounds_combine_by_each_coefficients_median(tmp_path):
    """Three rounds, one measured during a burst of other work: each coefficient is the middle round's,
    whichever round that is per coefficient; non-numeric fields and the host are the first's, and the
    saved file keeps every round's raw figures and loads back equal."""
    rounds = [
        _profile(call_overhead_s=5e-3, layer_overhead_s=3e-4, peak_flops=9e10),
        _profile(call_overhead_s=15e-3, layer_overhead_s=2e-4, peak_flops=8e10),  # the burst
        _profile(call_overhead_s=6e-3, layer_overhead_s=9e-4, peak_flops=9.2e10),
    ]
    for i, r in enumerate(rounds):
        r.measurements["startup_s"] = i
    combined = DeviceProfile.median_of(rounds)
    for dtype in ("float32", "bfloat16"):
        dev = combined.device(dtype)
        assert (dev.call_overhead_s, dev.layer_overhead_s) == (6e-3, 3e-4)
        assert dev.bytes_per_param == rounds[0].device(dtype).bytes_per_param and dev.measured
    assert combined.device("float32").peak_flops == 9e10 and combined.device("bfloat16").peak_flops == 2.7e11
    assert combined.host == {"threads": 1, "rounds": 3}
    assert [r["startup_s"] for r in combined.measurements["rounds"]] == [0, 1, 2]
    assert DeviceProfile.load(combined.save(tmp_path / "median.yaml")) == combined
    assert DeviceProfile.median_of(rounds[:1]) is rounds[0]


def test_a_version_1_profile_loads_without_the_path_terms_and_says_so(tmp_path, capsys):
    """Written before the path's fixed costs were measured: they stay 0 (not priced, as then), in one line."""
    loaded = _load_old(tmp_path, 1, (*PATH_FIELDS, "activation_s_per_element"))
    assert all(getattr(loaded.device("float32"), name) == 0.0 for name in PATH_FIELDS)
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert note.startswith(
        f"note: {tmp_path / 'v1.json'}: a version 1 device profile without the terms measured since (activation_s_per_element, "
        "call_overhead_s"
    )
    assert "hybridflow calibrate --out" in note
    assert DeviceProfile.from_dict(loaded.to_dict()).version == PROFILE_VERSION  # saved again: this version


def test_a_version_2_profile_prices_activations_at_0_and_says_so(tmp_path, capsys):
    loaded = _load_old(tmp_path, 2, ("activation_s_per_element",))
    assert loaded.device("float32").activation_s_per_element == 0.0
    assert loaded.device("float32").call_overhead_s == _profile().device("float32").call_overhead_s
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert "a version 2 device profile without the terms measured since (activation_s_per_element)" in note


def test_a_version_3_profile_prices_the_optimizer_on_dtensors_as_plain_and_says_so(tmp_path, capsys):
    dropped = ("fsdp_optimizer_step_overhead_s", "tp_optimizer_step_overhead_s")
    loaded = _load_old(tmp_path, 3, dropped, fsdp_optimizer_step_overhead_s=1e-3)
    assert loaded.device("float32").fsdp_optimizer_step_overhead_s == 0.0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert (
        "version 3 device profile without the terms measured since (fsdp_optimizer_step_overhead_s, " in note
    )


def test_a_version_12_profile_prices_no_wait_where_replicas_meet_and_says_so(tmp_path, capsys):
    dropped = ("sync_wait_s", "sync_wait_fraction")
    loaded = _load_old(tmp_path, 12, dropped, sync_wait_s=4e-4, sync_wait_fraction=0.3)
    assert (loaded.device("float32").sync_wait_s, loaded.device("float32").sync_wait_fraction) == (0.0, 0.0)
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert (
        "a version 12 device profile without the terms measured since (sync_wait_fraction, sync_wait_s)"
        in note
    )


def test_a_version_13_profile_prices_a_call_alike_at_any_ranks_and_says_so(tmp_path, capsys):
    loaded = _load_old(
        tmp_path, 13, ("call_rank_overhead_s",), call_rank_overhead_s=1e-3, call_overhead_s=4e-3
    )
    assert (loaded.device("float32").call_rank_overhead_s, loaded.device("float32").call_overhead_s) == (
        0.0,
        4e-3,
    )
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert "a version 13 device profile without the terms measured since (call_rank_overhead_s)" in note


def test_a_version_5_profile_prices_no_driver_work_and_says_so(tmp_path, capsys):
    """Version 6 added the driver's own work per step: a version 5 file loads it as 0 (the rest is then its
    calls alone, as that version priced it less the stages' calls) with a note naming it."""
    dropped = ("driver_step_overhead_s",)
    loaded = _load_old(tmp_path, 5, dropped, driver_step_overhead_s=4e-3, call_overhead_s=5e-3)
    assert loaded.device("float32").driver_step_overhead_s == 0.0
    assert loaded.device("float32").call_overhead_s == 5e-3 and loaded.version == PROFILE_VERSION == 14
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert "a version 5 device profile without the terms measured since (driver_step_overhead_s)" in note


def test_the_optimizer_on_dtensors_is_priced_where_the_layout_has_them():
    """The small Llama's training stage (one optimizer step) gains the term at d > 1 (FSDP2) or t > 1
    (tensor parallelism), each its own, and nothing at t = d = 1."""
    from hybridflow.planner.simulate import training_time

    base = _profile().device("float32")
    terms = _profile(fsdp_optimizer_step_overhead_s=1e-3, tp_optimizer_step_overhead_s=1e-2).device("float32")
    for (t, d), extra in {(1, 1): 0.0, (1, 2): 1e-3, (2, 1): 1e-2, (2, 2): 1.1e-2}.items():
        with_terms, without = (
            training_time(SMALL, dev, WORKLOAD, 4, 1, t, d, False) for dev in (terms, base)
        )
        assert with_terms - without == pytest.approx(extra, abs=1e-12), (t, d)


def test_the_engines_per_token_cost_by_hand():
    """512 rows of GRPO's shape at d = 2: 256 rows a rank, one micro-batch of 256 x (7/8 + 4) = 1,248 tokens
    (shared 7-token prompts, 4-token responses); the training term once per micro-batch (its passes
    together), the inference term once per forward."""
    from hybridflow.planner.simulate import inference_time, training_time

    wl = replace(WORKLOAD, prompt_len=9, mean_prompt_len=7.0, shared_prompts=True)
    base, terms = (
        _profile().device("float32"),
        _profile(train_token_overhead_s=1e-5, infer_token_overhead_s=1e-6),
    )
    terms = terms.device("float32")
    train = [training_time(SMALL, dev, wl, 4, 1, 1, 2, False) for dev in (terms, base)]
    infer = [inference_time(SMALL, dev, wl, 4, 1, 1, 2) for dev in (terms, base)]
    assert train[0] - train[1] == pytest.approx(1248 * 1e-5) and infer[0] - infer[1] == pytest.approx(
        1248 * 1e-6
    )
    # measured at half SMALL's width: SMALL pays twice the measured term a token; the per-micro-batch
    # terms once, at any width
    half = _profile(
        train_token_overhead_s=1e-5, token_overhead_width=SMALL.hidden / 2, train_batch_overhead_s=3e-3,
        infer_batch_overhead_s=1e-3,
    ).device("float32")  # fmt: skip
    assert training_time(SMALL, half, wl, 4, 1, 1, 2, False) - train[1] == pytest.approx(1248 * 2e-5 + 3e-3)
    assert inference_time(SMALL, half, wl, 4, 1, 1, 2) - infer[1] == pytest.approx(1e-3)


def test_engine_token_fit_recovers_a_known_residual():
    """Measured = the simulator's own seconds for the same rows + 3 us (training) and 1 us (inference) a
    token + 2 ms and 0.5 ms a micro-batch: the fit returns them; 64 and 256 rows of 7-token prompts are 312
    and 1,248 tokens. The profile's own engine terms (here the ones fitted before) are not part of the
    simulator's seconds it compares with."""
    from hybridflow.models.tiny import build_tiny_config
    from hybridflow.planner.fit import fit_engine_terms
    from hybridflow.planner.simulate import inference_time, training_time

    dev = _profile(micro_batch_overhead_s=1e-3, activation_s_per_element=1e-9).device("float32")
    stale = replace(dev, train_token_overhead_s=1e-4, train_batch_overhead_s=1.0, infer_batch_overhead_s=1.0)
    spec = ModelSpec.from_config_dict(build_tiny_config("tiny", "llama").to_dict())
    raw = {"rows": [64, 256], "prompt_len": [7.0, 7.0], "train_s": [], "infer_s": []}
    for rows, tokens in ((64, 312), (256, 1248)):
        wl = WorkloadSpec(rows // 8, 8, 7, 4, mini_batches=1, micro_batch_size=rows, inference_micro_batch_size=rows,
                          shared_prompts=True, mean_prompt_len=7.0)  # fmt: skip
        raw["train_s"].append(training_time(spec, dev, wl, 1, 1, 1, 1, False) + 3e-6 * tokens + 2e-3)
        raw["infer_s"].append(inference_time(spec, dev, wl, 1, 1, 1, 1) + 1e-6 * tokens + 5e-4)
    expected = {"train_token_overhead_s": 3e-6, "infer_token_overhead_s": 1e-6, "token_overhead_width": spec.hidden,
                "train_batch_overhead_s": 2e-3, "infer_batch_overhead_s": 5e-4}  # fmt: skip
    assert fit_engine_terms(raw, dev, spec) == pytest.approx(expected, rel=1e-6)
    assert fit_engine_terms(raw, stale, spec) == pytest.approx(expected, rel=1e-6)


def test_profile_refuses_what_it_cannot_read(tmp_path):
    good = _profile().to_dict()
    with pytest.raises(FileNotFoundError, match="hybridflow calibrate --out"):
        DeviceProfile.load(tmp_path / "none.yaml")
    cases = {
        "version": ({**good, "version": 0}, "version 0"),
        "field": ({**good, "devices": {"float32": {**good["devices"]["float32"], "tflops": 1}}}, "tflops"),
        "dtype": ({**good, "devices": {"fp8": good["devices"]["float32"]}}, "fp8"),
        "shape": ([1, 2], "no `devices` section"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            DeviceProfile.load(path)
    only_fp32 = DeviceProfile("x", {"float32": get_device("cpu")})
    with pytest.raises(ValueError, match="no bfloat16 measurements"):
        only_fp32.device("bfloat16")


def _grpo_plan(device, wl=WORKLOAD):
    return plan(
        build_dataflow("grpo", SMALL, reward_model=False), ClusterSpec.build(device, 4, 4), wl, LIMITS
    )


# 4 sequences: a replica at d = 4 holds one, so FSDP2's collectives and the calls are most of a stage
FEW_ROWS = replace(WORKLOAD, prompts=2, samples_per_prompt=2)


def test_a_plan_with_a_profile_differs_where_the_profile_does():
    """The catalogue's cpu entry makes collectives cheap (0.1 ms per hop), so GRPO's actor and reference
    share 4 devices at d = 4; a profile that measured 50 ms per hop prices the gradient all-reduce and the
    switch's gathers out: each model on one device of its own, no collective at all. A profile equal to the
    entry plans the same placement, and says it was measured."""
    catalogue = _grpo_plan(get_device("cpu"), FEW_ROWS)
    assert catalogue.strategy == "colocate" and catalogue.model("actor").d == 4
    assert not catalogue.device_measured
    slow_links = _grpo_plan(_profile(comm_latency_s=0.05).device("float32"), FEW_ROWS)
    assert all(m.n_devices == 1 for m in slow_links.models) and slow_links.device_measured
    assert slow_links.iteration_seconds > catalogue.iteration_seconds
    same = _grpo_plan(_profile().device("float32"), FEW_ROWS)
    assert [(m.pool, m.t, m.d) for m in same.models] == [(m.pool, m.t, m.d) for m in catalogue.models]
    assert same.iteration_seconds == pytest.approx(catalogue.iteration_seconds, rel=1e-12)


def test_a_plan_prices_the_calls_in_the_rest_whatever_the_placement():
    """A stage's calls are issued together and overlap, and a stage is measured from its workers' start, so
    a profile measuring 1 s a call (the catalogue's cpu entry none) adds one call for each of GRPO's three stages
    and the advantages' to the step's rest (4 x 1 s), leaving the stages and the placement as they were."""
    base = _grpo_plan(_profile().device("float32"), FEW_ROWS)
    slow_calls = _grpo_plan(_profile(call_overhead_s=1.0).device("float32"), FEW_ROWS)
    assert [(m.pool, m.t, m.d) for m in slow_calls.models] == [(m.pool, m.t, m.d) for m in base.models]
    assert slow_calls.stage_seconds == pytest.approx(base.stage_seconds, rel=1e-12)
    assert base.rest_seconds == 0.0 and slow_calls.rest_seconds == pytest.approx(4.0, rel=1e-12)
    assert slow_calls.iteration_seconds - base.iteration_seconds == pytest.approx(4.0, rel=1e-12)


def test_a_call_to_more_ranks_pays_the_rank_term_and_the_allocation_with_it():
    """Each of GRPO's four calls in the rest (its three stages' and the advantages') waits for every rank of
    the largest group it reaches: each alternative's rest is 4 x (its largest pool - 1) x the rank term. At
    1 ms a rank standalone [2, 2] (4 ms of rest) overtakes colocate [4] (12 ms); at 1 s a rank every
    placement's allocation is chosen with it too: one device a pool, no rest, where stage time alone took 4."""
    base = _grpo_plan(_profile().device("float32"), FEW_ROWS)
    assert [(a.strategy, a.allocation) for a in base.alternatives] == [
        ("colocate", [4]),
        ("standalone", [2, 2]),
    ]
    for per_rank_s, expected in ((1e-3, [("standalone", [2, 2]), ("colocate", [4])]),
                                 (1.0, [("standalone", [1, 1]), ("colocate", [1])])):  # fmt: skip
        plan = _grpo_plan(_profile(call_rank_overhead_s=per_rank_s).device("float32"), FEW_ROWS)
        assert [(a.strategy, a.allocation) for a in plan.alternatives] == expected
        for alt in plan.alternatives:
            rest = alt.iteration_seconds - sum(alt.stage_seconds.values())
            assert rest == pytest.approx(4 * per_rank_s * (max(alt.allocation) - 1), abs=1e-9), alt
        assert plan.rest_seconds == pytest.approx(4 * per_rank_s * (expected[0][1][0] - 1), abs=1e-12)


def test_the_calls_fit_from_real_runs_rests_by_hand():
    """step_rests' runs: 8 and 64 prompts x 8 samples, 16 + 4 tokens a row (a run that recorded none drawn
    longer: the config's cap), three rounds of calls (generation,
    advantages, update). The rest grew 3 ms from 64 to 512 rows on one rank: those 448 rows' tokens, 3 calls x
    both ways x 20 tokens x 32 bytes, moved in 3 ms. What is left of the small run's 12 ms beyond the driver's
    2 ms and its own rows' share (3 ms x 64 / 448) is three calls; two ranks added 3 ms, 1 ms a call."""
    dev = replace(get_device("cpu"), driver_step_overhead_s=2e-3, transfer_bandwidth=1e9, call_overhead_s=9.0)
    runs = [(1, 8, 12e-3), (1, 64, 15e-3), (2, 8, 15e-3)]
    raw = {"runs": [dict(ranks=n, prompts=p, rest_s=s) for n, p, s in runs], "workload": REST_RUN}
    terms = fit_call_terms(raw, dev)
    assert terms["transfer_bandwidth"] == pytest.approx(3 * 2 * 20 * 32 * 448 / 3e-3, rel=1e-9)
    assert terms["call_overhead_s"] == pytest.approx((12e-3 - 2e-3 - 3e-3 * 64 / 448) / 3, rel=1e-9)
    assert terms["call_rank_overhead_s"] == pytest.approx(1e-3, rel=1e-9)
    # the runs' batches padded to their longest prompt drawn, 8 tokens (the config's cap is 16): 12 a row
    # moved, and the small run's own rows priced at that width too
    drawn = {
        "runs": [dict(r, longest_prompt_len=8.0, mean_prompt_len=6.5) for r in raw["runs"]],
        "workload": REST_RUN,
    }
    terms = fit_call_terms(drawn, dev)
    assert terms["transfer_bandwidth"] == pytest.approx(3 * 2 * 12 * 32 * 448 / 3e-3, rel=1e-9)
    assert terms["call_overhead_s"] == pytest.approx((12e-3 - 2e-3 - 3e-3 * 64 / 448) / 3, rel=1e-9)
    # a rest below the driver's own work, smaller at 2 ranks, no larger at 512 rows: no negative price, and
    # the transfer stays the idle call's
    flat = [(1, 8, 1e-3), (1, 64, 1e-3), (2, 8, 0.5e-3)]
    raw = {"runs": [dict(ranks=n, prompts=p, rest_s=s) for n, p, s in flat], "workload": REST_RUN}
    assert fit_call_terms(raw, dev) == {
        "call_overhead_s": 0.0,
        "call_rank_overhead_s": 0.0,
        "transfer_bandwidth": 1e9,
    }


def test_activation_time_and_each_roles_micro_batch_by_hand():
    """A pass's non-matmul values at the profile's cost per value; a role's passes at its own micro-batch."""
    from hybridflow.planner.simulate import activation_time, inference_time

    spec = ModelSpec("m", 2, 64, 4, 2, 128, vocab_size=100)
    dev = _profile(activation_s_per_element=1e-9).device("float32")
    per_token = 2 * (12 * 64 + 4 * 128 + 3 * 4 * 10) / 2 + 4 * 100  # t = 2 splits the layers, not the head
    assert activation_time(spec, dev, 32, 10, 2, 2) == pytest.approx(32 * per_token * 1e-9)
    assert activation_time(spec, _profile().device("float32"), 32, 10, 2, 1) == 0.0  # not measured: 0
    shared = WorkloadSpec(8, 4, 16, 4, shared_prompts=True)  # a prompt once for its samples in a micro-batch
    assert shared.tokens_per_sequence(8) == 16 / 4 + 4 and shared.tokens_per_sequence(2) == 16 / 2 + 4
    assert replace(shared, shared_prompts=False).tokens_per_sequence(8) == 20
    wl = WorkloadSpec(64, 1, 8, 8, inference_micro_batch_size=8, role_micro_batches=(("critic", 4, 64),))
    assert wl.for_role("critic").inference_micro_batch_size == 64 and wl.for_role("actor") == wl
    dev = _profile(micro_batch_overhead_s=1e-2, layer_overhead_s=0.0).device("float32")
    one, eight = (inference_time(spec, dev, w, 2, 1, 1, 1) for w in (wl.for_role("critic"), wl))
    assert eight - one == pytest.approx(7 * 1e-2)  # 8 passes of 8 rows against 1 of 64


def test_passes_are_priced_at_the_mean_prompt_and_memory_at_the_bound():
    """A mean prompt of 7 tokens under a bound of 16: training and inference cost what 7-token prompts
    cost; generation's padded prefill, the KV cache and activations' memory keep 16."""
    from hybridflow.planner.parallel import enumerate_options
    from hybridflow.planner.simulate import generation_time, inference_time, training_time

    dev = get_device("cpu")  # no call or transfer terms: the rows' padded bytes cost nothing here
    mean, short = replace(WORKLOAD, mean_prompt_len=7.0), replace(WORKLOAD, prompt_len=7)
    assert mean.packed_seq_len == 11.0 and mean.seq_len == 20
    assert training_time(SMALL, dev, mean, 4, 1, 1, 2, False) == training_time(
        SMALL, dev, short, 4, 1, 1, 2, False
    )
    assert inference_time(SMALL, dev, mean, 4, 1, 1, 2) == inference_time(SMALL, dev, short, 4, 1, 1, 2)
    assert training_time(SMALL, dev, mean, 4, 1, 1, 2, False) < training_time(
        SMALL, dev, WORKLOAD, 4, 1, 1, 2, False
    )
    assert generation_time(SMALL, dev, mean, 4, 2, 1, 1) == generation_time(SMALL, dev, WORKLOAD, 4, 2, 1, 1)
    actor = build_dataflow("grpo", SMALL, reward_model=False).model("actor")
    cluster = ClusterSpec.build("cpu", 2, 2)
    memory = [
        [(o.persistent_bytes, o.transient_bytes) for o in enumerate_options(actor, cluster, w, 2)]
        for w in (mean, WORKLOAD)
    ]
    assert memory[0] == memory[1] and memory[0]
    with pytest.raises(ValueError, match="mean_prompt_len"):
        replace(WORKLOAD, mean_prompt_len=17.0)


def test_training_path_fit_by_hand():
    """Per-layer slopes of 1 and 5 layers; a micro-batch is 3 passes: t1d1's slope 3 ms is 1 ms a pass, its
    rest 7 ms is 2.33 ms a pass; d2's extra slope 3 ms and t2's 6 ms are 1 and 2 ms a layer pass; the
    optimizer step 1 ms a layer and 1 ms the rest on plain tensors; its rest at d2 (2 ms a layer) is 2 ms,
    at t2 (1 ms a layer) 5 ms: 1 and 4 ms more a step."""
    raw = {"t1d1/1": (0.010, 0.002), "t1d1/5": (0.022, 0.006), "t1d2/1": (0.016, 0.004),
           "t1d2/5": (0.040, 0.012), "t2d1/1": (0.019, 0.006), "t2d1/5": (0.055, 0.010)}  # fmt: skip
    fit = fit_training_path(raw)
    expected = dict(train_layer_pass_s=0.001, micro_batch_overhead_s=0.007 / 3, fsdp_layer_overhead_s=0.001,
                    tp_layer_overhead_s=0.002, optimizer_layer_overhead_s=0.001, optimizer_step_overhead_s=0.001,
                    fsdp_optimizer_step_overhead_s=0.001, tp_optimizer_step_overhead_s=0.004)  # fmt: skip
    assert {k: fit[k] for k in expected} == pytest.approx(expected, rel=1e-9)


def test_tp_layer_fit_by_hand_fixed_and_per_token():
    """At 32 tokens t2's layer slope 9 ms is 6 ms beyond t1's 3 ms: 2 ms a layer pass. At 512 tokens t1's slope
    8 ms grew 5 ms, of which a t = 2 rank does half (2.5 ms, priced as its split GEMMs and activations), so t2's
    25 ms is (25 - 8 + 2.5) / 3 = 6.5 ms a layer pass: 4.5 ms over 480 tokens (9.375 us a token), 1.7 ms fixed.
    Without the 512-token runs (an older measurement) the 32 tokens' figure is the fixed term, 0 per token."""
    raw = {"t1d1/1": (0.010, 0.002), "t1d1/5": (0.022, 0.006), "t1d2/1": (0.016, 0.004),
           "t1d2/5": (0.040, 0.012), "t2d1/1": (0.019, 0.006), "t2d1/5": (0.055, 0.010)}  # fmt: skip
    more = {"t1d1/1@512": (0.030, 0.002), "t1d1/5@512": (0.062, 0.006),
            "t2d1/1@512": (0.050, 0.006), "t2d1/5@512": (0.150, 0.010)}  # fmt: skip
    fit = fit_training_path({**raw, **more})
    assert fit["tp_token_overhead_s"] == pytest.approx(4.5e-3 / 480, rel=1e-9)
    assert fit["tp_layer_overhead_s"] == pytest.approx(2e-3 - 32 * 4.5e-3 / 480, rel=1e-9)
    old = fit_training_path(raw)
    assert old["tp_token_overhead_s"] == 0.0 and old["tp_layer_overhead_s"] == pytest.approx(2e-3, rel=1e-9)


def test_tp_per_token_term_grows_with_tokens_and_width_at_t_above_1():
    """1e-5 s a token a layer pass measured at width 64, on a width-128 model: 2e-5 s. An inference of 512
    rows of 20 tokens in two micro-batches of 5,120 tokens, 4 layers: 2 x 4 x 5,120 x 2e-5 = 0.8192 s more at
    t = 2, nothing at t = 1; generation's prefill and decode steps pay it over their tokens too."""
    from hybridflow.planner.simulate import generation_time, inference_time, tp_token_time

    spec = ModelSpec("m", 4, 128, 4, 2, 384, vocab_size=64)
    base = _profile(token_overhead_width=64.0).device("float32")
    dev = replace(base, tp_token_overhead_s=1e-5)
    assert tp_token_time(spec, dev, 100, 2) == pytest.approx(2e-3, rel=1e-12)
    assert tp_token_time(spec, dev, 100, 1) == 0.0
    assert tp_token_time(spec, replace(dev, token_overhead_width=0.0), 100, 2) == pytest.approx(
        1e-3, rel=1e-12
    )
    wl = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=256, inference_micro_batch_size=256)
    extra = inference_time(spec, dev, wl, 2, 1, 2, 1) - inference_time(spec, base, wl, 2, 1, 2, 1)
    assert extra == pytest.approx(2 * 4 * 5120 * 2e-5, rel=1e-9)
    assert inference_time(spec, dev, wl, 2, 1, 1, 1) == inference_time(spec, base, wl, 2, 1, 1, 1)
    # generation at tg = 2: 64 prompts' prefill (16 tokens each) and 4 decode steps of 512 tokens
    extra = generation_time(spec, dev, wl, 2, 2, 1, 2) - generation_time(spec, base, wl, 2, 2, 1, 2)
    assert extra == pytest.approx(4 * (64 * 16 + 4 * 512) * 2e-5, rel=1e-9)


def test_a_version_6_profile_prices_tp_per_token_at_0_and_says_so(tmp_path, capsys):
    loaded = _load_old(tmp_path, 6, ("tp_token_overhead_s",), tp_token_overhead_s=1e-5)
    assert loaded.device("float32").tp_token_overhead_s == 0.0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert "a version 6 device profile without the terms measured since (tp_token_overhead_s)" in note


def test_a_version_8_profile_prices_the_switch_per_fsdp_unit_as_then_and_says_so(tmp_path, capsys):
    """Version 9 measures the switch's fixed cost per unit gathered. A version 8 file priced FSDP2's unshard
    at its per-pass figure: it loads as that; the TP and stage terms, never priced, load as 0, named."""
    dropped = ("switch_fsdp_unit_s", "switch_tp_unit_s", "switch_stage_s")
    loaded = _load_old(tmp_path, 8, dropped, fsdp_layer_overhead_s=2e-3, switch_tp_unit_s=1e-3)
    dev = loaded.device("float32")
    assert (dev.switch_fsdp_unit_s, dev.switch_tp_unit_s, dev.switch_stage_s) == (2e-3, 0.0, 0.0)
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert (
        "a version 8 device profile without the terms measured since (switch_stage_s, switch_tp_unit_s)"
        in note
    )


def test_switch_fit_recovers_known_costs_per_unit():
    """Measured rounds = the simulator's bytes and all-reduce for the same rounds + 0.7 ms per FSDP2 unit (the
    tiny model's 2 layers and root), 0.5 ms per TP-gathered layer (2), 0.2 ms per stage (2): the fit returns
    them, whatever the profile's own switch terms were."""
    from hybridflow.models.tiny import build_tiny_config
    from hybridflow.planner.fit import fit_switch_terms
    from hybridflow.planner.simulate import switch_time

    dev = _profile(fsdp_layer_overhead_s=3e-3).device("float32")
    stale = replace(dev, switch_fsdp_unit_s=1.0, switch_tp_unit_s=1.0, switch_stage_s=1.0)
    spec = ModelSpec.from_config_dict(build_tiny_config("tiny", "llama").to_dict())
    bare = replace(dev, switch_fsdp_unit_s=0.0)
    raw = {
        "t1d2": switch_time(spec, bare, 2, 1, 1, 2, 1, 1) + 3 * 7e-4,
        "t2d1": switch_time(spec, bare, 2, 1, 2, 1, 1, 1) + 2 * 5e-4,
        "p2t1d1": switch_time(spec, bare, 2, 2, 1, 1, 1, 1) + 2 * 2e-4,
    }
    expected = {"switch_fsdp_unit_s": 7e-4, "switch_tp_unit_s": 5e-4, "switch_stage_s": 2e-4}
    assert fit_switch_terms(raw, dev, spec) == pytest.approx(expected, rel=1e-6)
    assert fit_switch_terms(raw, stale, spec) == pytest.approx(expected, rel=1e-6)


def test_fsdp_per_token_by_hand_and_fit_recovers_it():
    """At d = 2 each of a micro-batch's passes pays the term per layer per token: 512 rows of GRPO's shape,
    256 a rank, 1,248 tokens a micro-batch, SMALL's layers, 3 passes for training and 1 for inference; nothing
    at d = 1. Fitted from engine passes on 2 ranks that measured the simulator's seconds plus 4 us (training)
    and 1.5 us (inference) a token per layer pass, the fit returns them whatever the profile's own figures."""
    from hybridflow.models.tiny import build_tiny_config
    from hybridflow.planner.fit import fit_fsdp_token_terms
    from hybridflow.planner.simulate import inference_time, training_time

    wl = replace(WORKLOAD, prompt_len=9, mean_prompt_len=7.0, shared_prompts=True)
    base = _profile().device("float32")
    dev = replace(base, fsdp_train_token_overhead_s=1e-6, fsdp_infer_token_overhead_s=2e-7)
    layers = SMALL.num_layers
    train = training_time(SMALL, dev, wl, 4, 1, 1, 2, False) - training_time(
        SMALL, base, wl, 4, 1, 1, 2, False
    )
    infer = inference_time(SMALL, dev, wl, 4, 1, 1, 2) - inference_time(SMALL, base, wl, 4, 1, 1, 2)
    assert train == pytest.approx(3 * layers * 1248 * 1e-6) and infer == pytest.approx(layers * 1248 * 2e-7)
    assert training_time(SMALL, dev, wl, 4, 1, 1, 1, False) == training_time(
        SMALL, base, wl, 4, 1, 1, 1, False
    )

    dev = _profile(micro_batch_overhead_s=1e-3, fsdp_layer_overhead_s=2e-3, train_token_overhead_s=2e-6,
                   token_overhead_width=64.0).device("float32")  # fmt: skip
    stale = replace(dev, fsdp_train_token_overhead_s=1.0, fsdp_infer_token_overhead_s=1.0)
    spec = ModelSpec.from_config_dict(build_tiny_config("tiny", "llama").to_dict())
    raw = {"rows": [64, 256], "prompt_len": [7.0, 7.0], "dp2": {"train_s": [], "infer_s": []}}
    for rows, tokens in ((64, 312), (256, 1248)):
        wl = WorkloadSpec(2 * rows // 8, 8, 7, 4, mini_batches=1, micro_batch_size=rows,
                          inference_micro_batch_size=rows, shared_prompts=True, mean_prompt_len=7.0)  # fmt: skip
        per_layer = tokens * spec.num_layers
        raw["dp2"]["train_s"].append(training_time(spec, dev, wl, 2, 1, 1, 2, False) + 3 * per_layer * 4e-6)
        raw["dp2"]["infer_s"].append(inference_time(spec, dev, wl, 2, 1, 1, 2) + per_layer * 1.5e-6)
    expected = {"fsdp_train_token_overhead_s": 4e-6, "fsdp_infer_token_overhead_s": 1.5e-6}
    assert fit_fsdp_token_terms(raw, dev, spec) == pytest.approx(expected, rel=1e-6)
    assert fit_fsdp_token_terms(raw, stale, spec) == pytest.approx(expected, rel=1e-6)


def test_a_version_9_profile_prices_fsdp_per_token_at_0_and_says_so(tmp_path, capsys):
    dropped = ("fsdp_train_token_overhead_s", "fsdp_infer_token_overhead_s")
    loaded = _load_old(tmp_path, 9, dropped, fsdp_train_token_overhead_s=1e-6)
    assert loaded.device("float32").fsdp_train_token_overhead_s == 0.0
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert (
        "a version 9 device profile without the terms measured since (fsdp_infer_token_overhead_s, "
        "fsdp_train_token_overhead_s)" in note
    )


def test_plan_command_plans_with_a_profile(tmp_path, capsys):
    path = _profile(comm_latency_s=0.05).save(tmp_path / "cpu.yaml")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 384, "vocab_size": 64}))  # fmt: skip
    args = ["plan", "--model-config", str(config), "--gpus", "4", "--algorithm", "grpo", "--no-reward-model"]
    args += ["--max-pp", "1", "--tp-whole-heads", "--prompts", "64", "--samples-per-prompt", "8"]
    args += ["--prompt-len", "16", "--response-len", "4", "--mini-batches", "1"]
    assert main([*args, "--profile", str(path), "--output", str(tmp_path / "plan.json")]) == 0
    assert "x cpu-measured (measured profile)" in capsys.readouterr().out
    assert json.loads((tmp_path / "plan.json").read_text())["device_measured"] is True
    assert main([*args, "--gpu", "cpu"]) == 0
    assert "x cpu (catalogue entry, not measured)" in capsys.readouterr().out
    assert main([*args, "--profile", str(tmp_path / "none.yaml")]) == 2


def test_gemm_fit_recovers_a_known_curve():
    """rate(w) = 1e11 * w / (w + 64): 64 = 2^(24/4) lies on the fit's grid, so both come back exactly."""
    rates = {str(w): 1e11 * w / (w + 64) for w in (32, 64, 128, 256, 512, 1024)}
    peak, half = fit_gemm(rates)
    assert half == pytest.approx(64, rel=1e-12) and peak == pytest.approx(1e11, rel=1e-9)
    assert fit_gemm({"64": 5e10, "512": 5e10}) == pytest.approx((5e10, 0.0))  # flat: no fall-off


def test_resources_planner_profile_is_checked_before_anything_starts(tmp_path):
    from hybridflow.config.run_config import ResourcesConfig, resources_errors

    path = str(_profile().save(tmp_path / "cpu.yaml"))
    assert resources_errors(ResourcesConfig(placement="auto", planner_profile=path)) == []
    (error,) = resources_errors(ResourcesConfig(placement="colocate", planner_profile=path))
    assert error.startswith("resources.planner_profile: only resources.placement=auto")
    (error,) = resources_errors(ResourcesConfig(placement="auto", planner_profile=str(tmp_path / "no.yaml")))
    assert "hybridflow calibrate --out" in error
