"""Generation's terms measured on the built-in engine (fit.fit_decode_terms), the responses' text
(microbench.detokenize_costs) and the replicas' wait where they meet after decoding (fit.fit_sync_waits),
priced by simulate.generation_time; by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridflow.models.tiny import build_tiny_config
from hybridflow.planner.fit import fit_decode_terms, fit_sync_waits
from hybridflow.planner.microbench import DECODE_LAYERS
from hybridflow.planner.simulate import generation_time
from hybridflow.planner.specs import ModelSpec, WorkloadSpec, get_device

CPU = replace(get_device("cpu"), decode_step_overhead_s=0.0, layer_overhead_s=2e-4, call_overhead_s=3e-3)
SPEC = ModelSpec.from_config_dict(
    build_tiny_config("tiny", "llama", num_hidden_layers=DECODE_LAYERS).to_dict()
)


def _step(dev, rows: int) -> float:
    """The simulator's decode step of `rows` rows as the fit prices it: 17 new tokens less 1, over 16."""
    wl = lambda new: WorkloadSpec(rows, 1, 4, new, mini_batches=1, micro_batch_size=rows,  # noqa: E731
                                  inference_micro_batch_size=rows)  # fmt: skip
    return (
        generation_time(SPEC, dev, wl(17), 1, 1, 1, 1) - generation_time(SPEC, dev, wl(1), 1, 1, 1, 1)
    ) / 16


def test_the_fit_recovers_a_fixed_and_a_per_row_cost():
    truth = replace(CPU, decode_step_overhead_s=1e-4, decode_row_overhead_s=2e-6)
    steps = {"rows": [1, 256], "step_s": [_step(truth, 1), _step(truth, 256)]}
    assert fit_decode_terms(steps, CPU, SPEC) == pytest.approx(
        {"decode_step_overhead_s": 1e-4, "decode_row_overhead_s": 2e-6}
    )
    # terms already in the spec being fitted are not counted twice; the text is not part of a step
    stale = replace(CPU, decode_step_overhead_s=5e-3, decode_row_overhead_s=1.0, detokenize_row_s=1.0)
    assert fit_decode_terms(steps, stale, SPEC) == pytest.approx(fit_decode_terms(steps, CPU, SPEC))
    # an engine faster than the simulator's own terms at one row: no negative fixed cost
    assert (
        fit_decode_terms(
            {"rows": [1, 256], "step_s": [0.0, steps["step_s"][1] - steps["step_s"][0]]}, CPU, SPEC
        )["decode_step_overhead_s"]
        == 0.0
    )


def test_generation_prices_each_decode_step_per_row_and_the_text_once():
    """512 rows (64 prompts x 8) of 4 tokens on one device: the per-row step term 4 x 512 times, the text
    512 rows plus 2,048 tokens; on 2 data-parallel replicas each prices its half."""
    wl = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=256, inference_micro_batch_size=256)
    base = generation_time(SPEC, CPU, wl, 2, 1, 1, 1)
    dev = replace(CPU, decode_row_overhead_s=1e-6, detokenize_row_s=2e-6, detokenize_token_s=3e-7)
    assert generation_time(SPEC, dev, wl, 2, 1, 1, 1) - base == pytest.approx(
        4 * 512 * 1e-6 + 512 * 2e-6 + 2048 * 3e-7
    )
    half = generation_time(SPEC, dev, wl, 2, 2, 1, 1) - generation_time(SPEC, CPU, wl, 2, 2, 1, 1)
    assert half == pytest.approx((4 * 512 * 1e-6 + 512 * 2e-6 + 2048 * 3e-7) / 2)


def test_replicas_wait_for_each_other_where_they_meet_after_decoding():
    """On 2 replicas the generation ends in a collective (the switch's counters) that each replica reaches
    after its own decode: sync_wait_s plus sync_wait_fraction of that replica's seconds; one device never
    waits."""
    wl = WorkloadSpec(64, 8, 16, 4, mini_batches=1, micro_batch_size=256, inference_micro_batch_size=256)
    dev = replace(CPU, sync_wait_s=3e-4, sync_wait_fraction=0.25)
    replica = generation_time(SPEC, CPU, wl, 2, 2, 1, 1)
    assert generation_time(SPEC, dev, wl, 2, 2, 1, 1) == pytest.approx(1.25 * replica + 3e-4)
    assert generation_time(SPEC, dev, wl, 2, 1, 1, 1) == generation_time(SPEC, CPU, wl, 2, 1, 1, 1)


def test_the_sync_fit_recovers_a_fixed_wait_and_a_fraction_of_the_work():
    """Barriers after chunks of 0.1 and 3 ms waited latency + 0.2 ms + 0.3 x the chunk: the fit returns the
    0.2 ms beyond the latency (priced apart) and the 0.3; waits that do not grow with the chunk, or fall
    below the latency, price nothing negative."""
    latency, chunks = 1e-4, [1e-4, 3e-3]
    raw = {"chunk_s": chunks, "wait_s": [latency + 2e-4 + 0.3 * c for c in chunks]}
    assert fit_sync_waits(raw, latency) == pytest.approx({"sync_wait_s": 2e-4, "sync_wait_fraction": 0.3})
    flat = {"chunk_s": chunks, "wait_s": [5e-5, 4e-5]}
    assert fit_sync_waits(flat, latency) == {"sync_wait_s": 0.0, "sync_wait_fraction": 0.0}
