"""The step's terms beyond the stages' passes, each by hand: a replica's training micro-batch holds at most its
rows, the switch pays per unit it gathers, the plan's rest holds the step's calls and the driver's work."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.planner import ClusterSpec, ModelSpec, WorkloadSpec, build_dataflow, plan
from hybridflow.planner.simulate import BATCH_BYTES_PER_TOKEN, switch_time, training_time
from hybridflow.planner.specs import EngineLimits, get_device

SPEC = ModelSpec("m", num_layers=4, hidden=128, num_heads=4, num_kv_heads=2, ffn_hidden=384, vocab_size=64)
CPU = replace(get_device("cpu"), call_overhead_s=7e-3, transfer_bandwidth=6e8, micro_batch_overhead_s=1e-3)


def test_a_training_micro_batch_holds_at_most_the_replicas_rows():
    """512 rows at d = 4 leave a replica 128: a micro-batch of 256 prices as one of 128 (the engine runs the
    rows it holds); at d = 1 a replica holds 512 and the two micro-batch sizes differ."""
    wl = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=256)
    exact = replace(wl, micro_batch_size=128)
    assert training_time(SPEC, CPU, wl, 4, 1, 1, 4, False) == pytest.approx(
        training_time(SPEC, CPU, exact, 4, 1, 1, 4, False), rel=1e-12
    )
    assert training_time(SPEC, CPU, wl, 4, 1, 1, 1, False) != pytest.approx(
        training_time(SPEC, CPU, exact, 4, 1, 1, 1, False), rel=1e-3
    )


def test_the_switch_pays_each_unit_it_gathers():
    """Beyond its bytes, a switch round to tg = 1 pays per unit it gathers (simulate.switch_overhead): at d = 2
    FSDP2 unshards each of the 4 layers and the root (5 units); at t = 2 each layer's TP pieces are gathered (4:
    the root's embeddings and lm_head are whole over tp); at p = 2 each of the 2 stages is exchanged, and a
    stage of 2 layers at d = 2 unshards 3 units. Each term alone, at its layouts only; a layout that moves
    nothing pays nothing; the GPU entries measure no such cost."""
    fsdp, tp, stage = 2e-3, 3e-4, 5e-5
    terms = {"switch_fsdp_unit_s": fsdp, "switch_tp_unit_s": tp, "switch_stage_s": stage}
    cases = [((1, 1, 2), {"switch_fsdp_unit_s": 5}), ((1, 2, 1), {"switch_tp_unit_s": 4}),
             ((2, 1, 1), {"switch_stage_s": 2}), ((2, 1, 2), {"switch_stage_s": 2, "switch_fsdp_unit_s": 3}),
             ((2, 2, 2), {"switch_stage_s": 2, "switch_fsdp_unit_s": 3, "switch_tp_unit_s": 2})]  # fmt: skip
    for (p, t, d), units in cases:
        base = switch_time(SPEC, CPU, 4, p, t, d, 1, 1)
        priced = switch_time(SPEC, replace(CPU, **terms), 4, p, t, d, 1, 1)
        assert priced - base == pytest.approx(sum(n * terms[k] for k, n in units.items()), rel=1e-9), (
            p,
            t,
            d,
        )
    assert switch_time(SPEC, replace(CPU, **terms), 4, 1, 2, 1, 1, 2) == 0.0  # tg = t, p = d = 1: no switch
    assert all(getattr(get_device("a100-80"), k) == 0.0 for k in terms)


def test_the_plans_rest_holds_every_stages_call_the_advantages_and_the_drivers_work():
    """A stage is measured from its workers' start to their end, so its call is not in it: the rest holds
    GRPO's generation, preparation and training calls and the advantages' (each 7 ms + 2 x 512 rows x 20
    tokens x 32 bytes at 0.6 GB/s) and the driver's 2 ms a step; the catalogue's cpu entry prices none: 0.
    One step ahead the generation's call is the rollout pool's (in its generation seconds): three calls."""
    wl = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=256, inference_micro_batch_size=256)
    flow = build_dataflow("grpo", SPEC, reward_model=False)
    limits = EngineLimits(max_pp=1, max_pg=1)
    dev = replace(CPU, driver_step_overhead_s=2e-3)
    p = plan(flow, ClusterSpec.build(dev, 2, 2), wl, limits, schedule="sync")
    call = 7e-3 + 2 * 512 * 20 * BATCH_BYTES_PER_TOKEN / 6e8
    assert p.rest_seconds == pytest.approx(4 * call + 2e-3, rel=1e-12)
    assert p.iteration_seconds == pytest.approx(sum(p.stage_seconds.values()) + p.rest_seconds, rel=1e-12)
    assert all(
        a.iteration_seconds == pytest.approx(sum(a.stage_seconds.values()) + p.rest_seconds)
        for a in p.alternatives
    )
    ahead = plan(flow, ClusterSpec.build(dev, 2, 2), wl, limits, schedule="ahead")
    assert ahead.rollout_ahead == 1 and ahead.rest_seconds == pytest.approx(3 * call + 2e-3, rel=1e-12)
    catalogue = plan(flow, ClusterSpec.build(get_device("cpu"), 2, 2), wl, limits, schedule="sync")
    assert catalogue.rest_seconds == 0.0


def test_a_stage_prices_its_work_without_its_call():
    """The same training, inference and generation with a 7 ms call and with none take the same seconds."""
    from hybridflow.planner.simulate import generation_time, inference_time

    wl = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=256, inference_micro_batch_size=256)
    free = replace(CPU, call_overhead_s=0.0, transfer_bandwidth=0.0)
    for dev in (CPU, free):
        assert training_time(SPEC, dev, wl, 2, 1, 1, 2, False) == training_time(
            SPEC, free, wl, 2, 1, 1, 2, False
        )
        assert inference_time(SPEC, dev, wl, 2, 1, 1, 2) == inference_time(SPEC, free, wl, 2, 1, 1, 2)
        assert generation_time(SPEC, dev, wl, 2, 2, 1, 1) == generation_time(SPEC, free, wl, 2, 2, 1, 1)


def test_pipeline_stages_run_padded_rows_and_the_rest_packed_ones():
    """At p = 2 a pass runs every row at its padded length with its own prompt (a stage is built for one
    micro-batch shape): shared prompts and the prompts' mean length price as if absent, and so do the
    engine's per-token terms. At p = 1 they cut the tokens and the time."""
    from hybridflow.planner.simulate import inference_time

    padded = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=64, inference_micro_batch_size=64)
    packed = replace(padded, shared_prompts=True, mean_prompt_len=7.0)
    priced = replace(CPU, train_token_overhead_s=5e-5, infer_token_overhead_s=1e-5)
    for p in (1, 2):
        train = [training_time(SPEC, priced, wl, 2, p, 1, 1, False) for wl in (padded, packed)]
        infer = [inference_time(SPEC, priced, wl, 2, p, 1, 1) for wl in (padded, packed)]
        if (
            p == 2
        ):  # the engine's per-token terms were measured on the packed passes, which p = 2 does not run
            assert train[0] == pytest.approx(training_time(SPEC, CPU, padded, 2, p, 1, 1, False), rel=1e-12)
            assert train[0] == pytest.approx(train[1], rel=1e-12) and infer[0] == pytest.approx(
                infer[1], rel=1e-12
            )
        else:
            assert train[1] < 0.7 * train[0] and infer[1] < 0.7 * infer[0]


def test_padded_passes_and_the_batches_run_at_the_longest_prompt():
    """Batches are left-padded to their longest prompt, not to data.max_prompt_length: where the data's
    longest prompt is known (9 of a 16-token bound), generation's prefill and cache, the pipelined stages'
    padded rows and the calls' batches are priced at 9 + 4 tokens a row; a 9-token bound prices the same;
    memory keeps the bound (seq_len)."""
    from hybridflow.planner.simulate import generation_time, stage_call_time, step_rest_time

    bound = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=64, inference_micro_batch_size=64)
    known, short = replace(bound, longest_prompt_len=9), replace(bound, prompt_len=9)
    assert (known.seq_len, known.padded_seq_len, known.packed_seq_len) == (20, 13, 13)
    for price in (
        lambda wl: generation_time(SPEC, CPU, wl, 2, 2, 1, 1),
        lambda wl: training_time(SPEC, CPU, wl, 2, 2, 1, 1, False),
        lambda wl: stage_call_time(CPU, wl, "generation") + stage_call_time(CPU, wl, "training"),
        lambda wl: step_rest_time(CPU, wl, ("generation",)),
    ):
        assert price(known) == pytest.approx(price(short), rel=1e-12) and price(known) < price(bound)
    with pytest.raises(ValueError, match="longest_prompt_len"):
        replace(bound, longest_prompt_len=17)


def test_a_pipeline_stage_pays_its_per_token_term_and_the_fit_recovers_it():
    """At p = 2 each slot (a stage's pass over a micro-batch: 8 micro-batches of 64 rows of 20 tokens, m + p
    - 1 = 9 slots) pays the pipelined engine's term per token; at p = 1 nothing. Passes on 2 stages measured
    at the simulator's seconds plus 3 us (training) and 1.5 us (inference) a token: the fit returns them,
    whatever the profile's own figures (microbench_path.engine_passes' "pp2" rows, padded to 9 + 4)."""
    from hybridflow.planner.fit import GROUP, PROMPT, RESPONSE, fit_pipeline_token_terms
    from hybridflow.planner.simulate import inference_time

    wl = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=64, inference_micro_batch_size=64)
    dev = replace(CPU, pipeline_train_token_overhead_s=2e-6, pipeline_infer_token_overhead_s=1e-6)
    train = training_time(SPEC, dev, wl, 2, 2, 1, 1, False) - training_time(SPEC, CPU, wl, 2, 2, 1, 1, False)
    infer = inference_time(SPEC, dev, wl, 2, 2, 1, 1) - inference_time(SPEC, CPU, wl, 2, 2, 1, 1)
    assert train == pytest.approx(9 * 64 * 20 * 2e-6) and infer == pytest.approx(9 * 64 * 20 * 1e-6)
    assert training_time(SPEC, dev, wl, 2, 1, 1, 1, False) == training_time(SPEC, CPU, wl, 2, 1, 1, 1, False)

    truth = replace(CPU, pipeline_train_token_overhead_s=3e-6, pipeline_infer_token_overhead_s=1.5e-6)
    raw = {"rows": [64, 256], "pp2": {"train_s": [], "infer_s": []}}
    for rows in raw["rows"]:
        w = WorkloadSpec(rows // GROUP, GROUP, PROMPT[1], RESPONSE, mini_batches=1, micro_batch_size=rows,
                         inference_micro_batch_size=rows)  # fmt: skip
        raw["pp2"]["train_s"].append(training_time(SPEC, truth, w, 2, 2, 1, 1, False))
        raw["pp2"]["infer_s"].append(inference_time(SPEC, truth, w, 2, 2, 1, 1))
    expected = {"pipeline_train_token_overhead_s": 3e-6, "pipeline_infer_token_overhead_s": 1.5e-6}
    assert fit_pipeline_token_terms(raw, CPU, SPEC) == pytest.approx(expected, rel=1e-6)
    assert fit_pipeline_token_terms(raw, dev, SPEC) == pytest.approx(expected, rel=1e-6)
